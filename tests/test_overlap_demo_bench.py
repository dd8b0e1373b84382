"""`leancompile bench overlap` (small sizes) and `leancompile demo overlap` (torchrun)."""

import json
import subprocess
import sys

from leancompile.benchmarks.overlap import main as bench_main


def test_bench_overlap_json(capsys):
    assert bench_main(["--nproc", "2", "--seq", "64", "--dim", "32", "--hidden", "64",
                       "--iters", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    schemes = report["schemes"]
    assert set(schemes) == {"sequential", "slice", "flash", "direct"}
    assert schemes["sequential"]["ratio_to_sequential"] == 1.0
    for name, entry in schemes.items():
        assert entry["total_s"] > 0 and entry["max_abs_diff"] <= 1e-4, (name, entry)
        assert entry["rewritten_sites"] == (0 if name == "sequential" else 4), (name, entry)


def test_demo_overlap_losses_agree():
    proc = subprocess.run([sys.executable, "-m", "leancompile.cli", "demo", "overlap"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "losses agree (rel 1e-5): yes" in proc.stdout
    assert "graph0_forward: 4 rewritten" in proc.stdout
    assert "graph0_backward: 6 rewritten" in proc.stdout
