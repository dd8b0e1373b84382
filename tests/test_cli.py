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


FSDP_EXAMPLE = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    def step(x, w1, b1, w2):  # FSDP-style: every parameter part gathered inside the step
        full = [funcol.all_gather_tensor_autograd(p, 0, dist.group.WORLD) for p in (w1, b1, w2)]
        h = torch.relu(torch.nn.functional.linear(x, full[0], full[1]))
        return torch.nn.functional.linear(h, full[2])

    def example_args():
        return (torch.randn(4, 16), torch.randn(16, 16, requires_grad=True),
                torch.randn(16, requires_grad=True), torch.randn(8, 32, requires_grad=True))
""")


def test_cli_explain_buckets_under_a_fake_world(tmp_path, capsys):
    """``leancompile explain FILE:step --fake-world 2 --bucket-cap-mb 1 --device h200``: the
    three gathers and three reduce-scatters become one of each, and the simulator predicts
    the exposed communication before and after."""
    (tmp_path / "fsdp_step.py").write_text(FSDP_EXAMPLE)
    assert main(["explain", f"{tmp_path / 'fsdp_step.py'}:step", "--fake-world", "2",
                 "--bucket-cap-mb", "1", "--compiler", "aot_eager", "--device", "h200"]) == 0
    out = capsys.readouterr().out
    assert "rewrote 3 x all_gather into bucket 0" in out, out
    assert "rewrote 3 x reduce_scatter into bucket 0" in out, out
    assert "_c10d_functional.all_gather_into_tensor.default: 3 -> 1" in out, out
    assert "predicted exposed communication on h200" in out, out


def test_cli_errors(example_file, tmp_path):
    with pytest.raises(SystemExit, match="expected FILE.py:NAME"):
        main(["explain", str(example_file)])
    with pytest.raises(SystemExit, match="has no 'missing'"):
        main(["explain", f"{example_file}:missing"])
    with pytest.raises(SystemExit, match="no such file"):
        main(["explain", f"{tmp_path}/nope.py:step"])
    with pytest.raises(SystemExit, match="defines no 'nope'"):
        main(["explain", f"{example_file}:step", "--args", "nope"])
