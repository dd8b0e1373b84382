"""The command line: `leancompile explain FILE.py:NAME` and its errors."""

import json
import subprocess
import sys
import textwrap

import pytest

from leancompile.cli import main

EXAMPLE = textwrap.dedent("""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def step(x):
        return model(x).square().mean()

    def example_args():
        return (torch.randn(3, 8),)

    other_args = (torch.randn(5, 8),)
""")


@pytest.fixture
def example_file(tmp_path):
    path = tmp_path / "example.py"
    path.write_text(EXAMPLE)
    return path


def test_cli_explain_file_target_prints_and_saves(example_file, tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "leancompile.cli", "explain", f"{example_file}:step",
         "--compiler", "aot_eager", "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "graph0_forward" in proc.stdout and "graph0_backward" in proc.stdout
    assert (out / "report.html").is_file() and (out / "graph0_backward_after.py").is_file()


def test_cli_explain_json_and_other_args(example_file, capsys):
    assert main(["explain", f"{example_file}:model", "--args", "other_args",
                 "--compiler", "aot_eager", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [g["name"] for g in data["graphs"]] == ["graph0_forward", "graph0_backward"]
    assert data["graphs"][0]["passes"][0]["name"] == "canonicalize"


def test_cli_explain_module_target(example_file, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(example_file.parent))
    assert main(["explain", "example:step", "--compiler", "aot_eager"]) == 0
    assert "graph0_backward" in capsys.readouterr().out


def test_cli_errors(example_file, tmp_path):
    with pytest.raises(SystemExit, match="expected FILE.py:NAME"):
        main(["explain", str(example_file)])
    with pytest.raises(SystemExit, match="has no 'missing'"):
        main(["explain", f"{example_file}:missing"])
    with pytest.raises(SystemExit, match="no such file"):
        main(["explain", f"{tmp_path}/nope.py:step"])
    with pytest.raises(SystemExit, match="defines no 'nope'"):
        main(["explain", f"{example_file}:step", "--args", "nope"])
