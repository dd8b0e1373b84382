"""The test harness's rank starter (``tests/ranks.py``): a rank that dies of a signal in C++
runs every rank again once, with a warning naming its last stderr lines; a second crash fails
with them; a Python error in a rank fails at once."""

import os
import resource

import pytest
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from ranks import RankCrashWarning, spawn


def _abort():
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file, whatever the machine's limit
    os.abort()


def _abort_first_time(rank, marks, init):
    """Rank 1 aborts on the first run (after a line on its stderr); on the second it checks
    that the dead run's rendezvous file is gone."""
    if rank == 1:
        if not os.path.exists(os.path.join(marks, "aborted")):
            open(os.path.join(marks, "aborted"), "w").close()
            os.write(2, b"about to abort: run 1\n")
            _abort()
        assert not os.path.exists(init), "the dead run's rendezvous file was left"
    open(os.path.join(marks, f"ran{rank}"), "w").close()


def _abort_always(rank, marks):
    if rank == 0:
        os.write(2, b"about to abort again\n")
        _abort()


def _raise(rank, marks):
    open(os.path.join(marks, f"raised{rank}"), "a").write("x")
    raise ValueError(f"rank {rank} fails in Python")


def test_a_crashed_rank_runs_every_rank_again_once_and_says_so(tmp_path):
    init = tmp_path / "init"
    init.write_text("keys of a run that died")
    with pytest.warns(RankCrashWarning, match=r"rank 1 of .*_abort_first_time died with SIGABRT: "
                                              r"about to abort: run 1"):
        spawn(_abort_first_time, args=(str(tmp_path), str(init)), nprocs=2)
    assert {p.name for p in tmp_path.iterdir()} == {"aborted", "ran0", "ran1"}


def test_a_second_crash_fails_with_the_ranks_last_lines(tmp_path):
    with pytest.warns(RankCrashWarning), \
            pytest.raises(ProcessExitedException, match="about to abort again.*the second time"):
        spawn(_abort_always, args=(str(tmp_path),), nprocs=2)


def test_a_python_error_in_a_rank_fails_without_a_second_run(tmp_path):
    with pytest.raises(ProcessRaisedException, match="fails in Python"):
        spawn(_raise, args=(str(tmp_path),), nprocs=2)
    assert all(p.read_text() == "x" for p in tmp_path.glob("raised*"))
