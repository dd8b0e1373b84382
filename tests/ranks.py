"""Start the ranks of a multi-process test: ``spawn(fn, args, nprocs)`` is
``torch.multiprocessing.spawn`` (``fn(rank, *args)`` in each of ``nprocs`` processes, joined,
a rank's exception raised here) through a fork server.

A spawned process starts a fresh interpreter and imports torch, leancompile and the test's
models again: 3-5 s of CPU per rank, and the suite starts about a hundred ranks on two cores.
The fork server is started once per test process with those modules imported (nothing else
runs in it: no threads, no process group), and each rank is a fork of it. Each rank gets this
process's environment as it is at the call (a fork server keeps the one it started with).

A rank that dies of a signal in C++ (``CRASH_SIGNALS``) is a known open defect of gloo runs on
this machine kind: three times in about 55 CI runs of the suite one rank of a FlashOverlap test
aborted (glibc's "malloc(): unaligned tcache chunk detected", "terminate called without an
active exception", and one with no text on record), never reproduced in hundreds of runs of the
same tests alone, under load, or of a teardown stress of the P2P ops. So that the next one says
where it happened, each rank writes its stderr to a file with ``faulthandler`` on (the Python
stack at the signal), and the parent prints every rank's file after the join; the crash's last
lines go into the error. A joined ``spawn`` runs all ranks again once after such a crash, with
a ``RankCrashWarning`` that names them; a Python error or assertion in a rank, or a second
crash, fails as before."""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import shutil
import sys
import tempfile
import warnings

import torch.multiprocessing as mp
from torch.multiprocessing import ProcessExitedException

import collector

PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx",
           "torch.distributed.tensor", "leancompile", "leancompile.grpo.trainer",
           "diffusers.models.transformers.transformer_flux",
           "diffusers.models.transformers.transformer_wan", "peft"]


CRASH_SIGNALS = ("SIGABRT", "SIGSEGV", "SIGBUS")
"""Signals that end a rank inside C++ (not a Python error): a joined ``spawn`` retries once."""


class RankCrashWarning(UserWarning):
    """A rank died of a signal and the ranks ran again (see the module docstring)."""


def _with_environment(rank, environ, logs, fn, *args):
    os.environ.clear()
    os.environ.update(environ)
    if logs is not None:  # this rank's stderr (fd 2: Python's, glibc's, C++'s) into a file
        log = open(os.path.join(logs, f"rank{rank}.stderr"), "w")  # noqa: SIM115 - till exit
        os.dup2(log.fileno(), 2)
        faulthandler.enable()
    collector.settle()
    return fn(rank, *args)


def _start(fn, args, nprocs, join, logs):
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return mp.start_processes(_with_environment, args=(dict(os.environ), logs, fn, *args),
                              nprocs=nprocs, join=join, start_method="forkserver")


def _echo(logs: str, nprocs: int) -> dict[int, str]:
    """Every rank's stderr, printed here (where pytest captures it) and returned."""
    texts = {}
    for rank in range(nprocs):
        path = os.path.join(logs, f"rank{rank}.stderr")
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                texts[rank] = f.read()
            if texts[rank]:
                sys.stderr.write(f"--- rank {rank} stderr ---\n{texts[rank]}")
    shutil.rmtree(logs, ignore_errors=True)
    return texts


def _crash_lines(text: str) -> str:
    """What a crashed rank's stderr says, on one line: the last lines before faulthandler's
    report (glibc's or C++'s own message), the signal, and the innermost Python frames."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    fatal = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")),
                 None)
    if fatal is None:
        picked = [line for line in lines if not line.startswith("Extension modules")][-6:]
    else:
        frames = [line for line in lines[fatal:] if line.startswith("File ")]
        picked = lines[max(0, fatal - 3):fatal + 1] + frames[:3]
    return " | ".join(picked)[:800] or "(nothing on its stderr)"


def _clear_rendezvous(args) -> None:
    """The ranks' FileStore (an argument naming a file called ``init``) outlives a crash with
    the dead run's keys in it; a new run needs it gone."""
    for arg in args:
        if isinstance(arg, str) and os.path.basename(arg) == "init" and os.path.exists(arg):
            os.remove(arg)


def spawn(fn, args=(), nprocs=2, join=True):
    """``torch.multiprocessing.start_processes`` through the fork server (``join=False``
    returns the context, as there, and leaves the ranks' stderr where it is)."""
    if not join:
        return _start(fn, args, nprocs, False, None)
    for attempt in (1, 2):
        logs = tempfile.mkdtemp(prefix="leancompile-ranks-")
        try:
            return _start(fn, args, nprocs, True, logs)
        except ProcessExitedException as e:
            if e.signal_name not in CRASH_SIGNALS:
                raise
            tail = _crash_lines(_echo(logs, nprocs).get(e.error_index, ""))
            what = (f"rank {e.error_index} of {fn.__module__}.{fn.__qualname__} died with "
                    f"{e.signal_name}: {tail}")
            if attempt == 2:
                raise ProcessExitedException(f"{what} (the second time; see tests/ranks.py)",
                                             e.error_index, e.error_pid, e.exit_code,
                                             e.signal_name) from e
            warnings.warn(RankCrashWarning(f"{what}; all ranks run again once (an open "
                                           "defect: tests/ranks.py)"), stacklevel=2)
            _clear_rendezvous(args)
        finally:
            if os.path.isdir(logs):
                _echo(logs, nprocs)
    raise AssertionError("unreachable")


def from_rank(rank: int, src: int, fn):
    """Inside a rank: ``fn()`` run on rank ``src`` only and sent to every rank (a
    single-process reference is the same on every rank, and the ranks share the cores)."""
    import torch.distributed as dist

    box = [fn() if rank == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]
