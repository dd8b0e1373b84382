"""Start the ranks of a multi-process test: ``spawn(fn, args, nprocs)`` is
``torch.multiprocessing.spawn`` (``fn(rank, *args)`` in each of ``nprocs`` processes, joined,
a rank's exception raised here) through a fork server.

A spawned process starts a fresh interpreter and imports torch, leancompile and the test's
models again: 3-5 s of CPU per rank, and the suite starts about a hundred ranks on two cores.
The fork server is started once per test process with those modules imported (nothing else
runs in it: no threads, no process group), and each rank is a fork of it. Each rank gets this
process's environment as it is at the call (a fork server keeps the one it started with)."""

from __future__ import annotations

import multiprocessing
import os

import torch.multiprocessing as mp

import collector

PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx",
           "torch.distributed.tensor", "leancompile", "leancompile.grpo.trainer",
           "diffusers.models.transformers.transformer_flux",
           "diffusers.models.transformers.transformer_wan", "peft"]


def _with_environment(rank, environ, fn, *args):
    os.environ.clear()
    os.environ.update(environ)
    collector.settle()
    return fn(rank, *args)


def spawn(fn, args=(), nprocs=2, join=True):
    """``torch.multiprocessing.start_processes`` through the fork server (``join=False``
    returns the context, as there)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return mp.start_processes(_with_environment, args=(dict(os.environ), fn, *args),
                              nprocs=nprocs, join=join, start_method="forkserver")


def from_rank(rank: int, src: int, fn):
    """Inside a rank: ``fn()`` run on rank ``src`` only and sent to every rank (a
    single-process reference is the same on every rank, and the ranks share the cores)."""
    import torch.distributed as dist

    box = [fn() if rank == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]
