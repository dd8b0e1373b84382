"""`leancompile bench overlap` (small sizes) and `leancompile demo overlap` (torchrun)."""

import json
import subprocess
import sys
import warnings

from torch.multiprocessing import ProcessExitedException

from leancompile.benchmarks.overlap import main as bench_main


def test_bench_overlap_json(capsys):
    args = ["--nproc", "2", "--seq", "64", "--dim", "32", "--hidden", "64", "--iters", "2",
            "--json"]
    try:
        assert bench_main(args) == 0
    except ProcessExitedException as e:
        # Known open defect: in 2 of ~15 full-suite runs (never in ~150 runs of this test
        # alone, nor under valgrind) rank 0 died with glibc's "malloc(): unaligned tcache
        # chunk detected" (SIGABRT). The workers now enable faulthandler, so a repeat prints
        # the Python stack. Retried once, on that signal only, so that it stays visible here
        # without failing unrelated changes; any other failure, or a second abort, fails.
        if e.signal_name != "SIGABRT":
            raise
        warnings.warn(f"bench overlap: a rank aborted ({e}); retrying once")
        capsys.readouterr()
        assert bench_main(args) == 0
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


def test_bench_overlap_ulysses_case(capsys):
    assert bench_main(["--case", "ulysses", "--nproc", "2", "--seq", "64", "--dim", "32",
                       "--heads", "4", "--iters", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["case"] == "ulysses"
    schemes = report["schemes"]
    assert set(schemes) == {"sequential", "flash"}
    # Query and output all-to-all in the forward, grad_out and grad_query in the backward.
    assert schemes["flash"]["rewritten_sites"] == 4 and schemes["flash"]["max_abs_diff"] <= 1e-5


def test_demo_overlap_sequence_parallel_losses_agree():
    proc = subprocess.run([sys.executable, "-m", "leancompile.cli", "demo", "overlap", "--sp"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "losses agree (rel 1e-5): yes" in proc.stdout
    assert "graph0_forward: 4 rewritten" in proc.stdout
    assert "graph0_backward: 4 rewritten" in proc.stdout
