"""Checkpoints of a ``GRPOTrainer``: ``trainer.save(run_dir)`` and ``GRPOTrainer.load(run_dir,
policy, reward_fn, optimizer)``.

A run directory holds one sub-directory per saved step and a ``latest`` file naming the newest::

    run_dir/
      latest                   "step_00000012"
      step_00000012/
        trainable.safetensors  the trainable parameters by name (full fine-tuning: all of
                               them; LoRA: the adapters)
        adapter/               peft's own adapter folder (save_pretrained), when the policy's
                               model is a peft model
        reference.safetensors  the KL reference copy (``beta > 0``, reference ``copy``)
        optimizer.pt           ``optimizer.state_dict()``
        rng.pt                 torch's CPU (and CUDA) generator states, Python's ``random``
        trainer.json           step count, config, trainable names and shapes, world size

Atomic: a step is written into ``step_K.tmp-<random>`` and renamed to ``step_K`` only when
complete (a rename within a directory is atomic on POSIX), then ``latest`` is replaced by a
rename of its own temporary file. A crash at any point leaves ``latest`` naming a complete
checkpoint (the previous one until the new one is in place); leftover ``*.tmp-*`` folders are
ignored and can be deleted. Data parallel: parameters are replicated, rank 0 writes, every rank
waits for it (a barrier) and loads the same files. Sharded (``parallel="fsdp"``): instead of
``trainable.safetensors`` and ``optimizer.pt``, ``sharded/`` holds the parameters as written by
``torch.distributed.checkpoint`` from every rank's ``DTensor`` ``Shard(0)`` parts, and
``optimizer.rank<R>.pt`` each rank's optimizer state for its parts (resuming needs the same
world size); every rank writes into the same temporary folder (a file system all ranks see,
as ``torch.distributed.checkpoint`` needs), rank 0 renames it into place.

Resuming reproduces the uninterrupted run: the same parameters, optimizer moments, step count
and random states, so step ``k + 1`` after a load equals step ``k + 1`` of a run that never
stopped, given the same conditions and generator seeds (tested bitwise).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import secrets
import shutil
from pathlib import Path

import torch

from .fsdp import full_shapes

__all__ = ["latest_checkpoint", "load_into", "save"]

_FORMAT = 1


def latest_checkpoint(path) -> Path:
    """The checkpoint folder ``path`` names: ``path`` itself when it holds a ``trainer.json``,
    else the one named by ``path/latest``."""
    path = Path(path)
    if (path / "trainer.json").is_file():
        return path
    latest = path / "latest"
    if not latest.is_file():
        raise FileNotFoundError(f"{path} is neither a checkpoint (no trainer.json) nor a run "
                                "directory (no 'latest' file); pass what trainer.save() wrote")
    found = path / latest.read_text().strip()
    if not (found / "trainer.json").is_file():
        raise FileNotFoundError(f"{latest} names {found.name}, which holds no trainer.json")
    return found


def _peft_model(policy):
    for module in policy.modules():
        if hasattr(module, "peft_config") and hasattr(module, "save_pretrained"):
            return module
    return None


def _write(trainer, folder: Path) -> None:
    from safetensors.torch import save_file

    params = dict(trainer.policy.named_parameters())
    sharded = trainer.sharding is not None
    if not sharded:  # sharded: torch.distributed.checkpoint wrote them (_save_sharded)
        save_file({n: params[n].detach().contiguous().cpu() for n in trainer.trainable},
                  str(folder / "trainable.safetensors"))
        peft_model = _peft_model(trainer.policy)
        if peft_model is not None:
            peft_model.save_pretrained(str(folder / "adapter"))
    if trainer.reference is not None:
        save_file({n: t.detach().contiguous().cpu()
                   for n, t in trainer.reference.weights.items()},
                  str(folder / "reference.safetensors"))
    if trainer.optimizer is not None and not sharded:
        torch.save(trainer.optimizer.state_dict(), folder / "optimizer.pt")
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, folder / "rng.pt")
    shapes = full_shapes(trainer.policy)
    meta = {"format": _FORMAT, "step": trainer.step_count,
            "config": dataclasses.asdict(trainer.config),
            "trainable": {n: list(shapes[n]) for n in trainer.trainable},
            "sharded": sharded,
            "world_size": trainer.parallel.world_size,
            "parallel": trainer.parallel.parallel}
    (folder / "trainer.json").write_text(json.dumps(meta, indent=2, default=str))


def _save_sharded(trainer, tmp: Path) -> None:
    """``parallel="fsdp"``: every rank writes its parameter parts through
    ``torch.distributed.checkpoint`` (``DTensor`` ``Shard(0)`` views, so the files do not
    depend on the padding) and its optimizer state (for its parts) as
    ``optimizer.rank<R>.pt``, all into ``tmp``, which every rank must see."""
    import torch.distributed.checkpoint as dcp

    par = trainer.parallel
    dcp.save({"trainable": trainer.sharding.dtensors(trainer.policy)},
             checkpoint_id=str(tmp / "sharded"), process_group=par.group)
    if trainer.optimizer is not None:
        torch.save(trainer.optimizer.state_dict(), tmp / f"optimizer.rank{par.rank:05d}.pt")


def save(trainer, run_dir) -> Path:
    """Write the trainer's state as ``run_dir/step_K`` (K = steps taken) and point
    ``run_dir/latest`` at it; returns the checkpoint folder. Collective when data parallel
    (``fsdp``: every rank writes its parts, into a folder all ranks must see). With a
    sequence-parallel policy, rank 0 of its group writes and the group waits for it (under
    fsdp: the data-parallel group of the sequence-parallel groups' ranks 0 writes the
    parts)."""
    run_dir = Path(run_dir)
    name = f"step_{trainer.step_count:08d}"
    final = run_dir / name
    par = trainer.parallel
    # A sequence-parallel policy: every rank of its group holds the same state; one writes.
    sequence = trainer.sequence_sync
    writer = par.rank == 0 and (sequence is None or sequence.rank == 0)
    tmp = None
    if writer:
        run_dir.mkdir(parents=True, exist_ok=True)
        while True:  # a fresh folder (a suffix of hex digits, see below)
            tmp = run_dir / f"{name}.tmp-{secrets.randbits(40):x}"
            try:
                tmp.mkdir()
                break
            except FileExistsError:
                continue
    if trainer.sharding is not None:
        # Every rank writes into rank 0's temporary folder: its random suffix is broadcast
        # (as a number, through the trainer's collectives, so a dead rank 0 is an error
        # within timeout_s, not a hang).
        suffix = par.broadcast_int(0 if tmp is None else int(tmp.name.rsplit("-", 1)[1], 16))
        tmp = run_dir / f"{name}.tmp-{suffix:x}"
        if sequence is None or sequence.rank == 0:  # the other positions hold the same parts
            _save_sharded(trainer, tmp)
        par.barrier()
    if writer:
        _write(trainer, tmp)
        if final.exists():  # saved twice at one step: keep the newest
            stale = final.with_name(f"{name}.old-{os.getpid()}")
            os.replace(final, stale)
            os.replace(tmp, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.replace(tmp, final)
        pointer = run_dir / f"latest.tmp-{os.getpid()}"
        pointer.write_text(name)
        os.replace(pointer, run_dir / "latest")
    par.barrier()
    if sequence is not None:
        sequence.barrier()
    return final


def _load_sharded(trainer, folder: Path, meta: dict) -> None:
    """``parallel="fsdp"``: the parameter parts through ``torch.distributed.checkpoint``
    (in place, into this rank's parts) and this rank's optimizer state."""
    import torch.distributed.checkpoint as dcp

    par = trainer.parallel
    state = None
    if trainer.optimizer is not None:  # checked before anything is loaded
        if meta["world_size"] != par.world_size:
            raise ValueError(
                f"{folder} holds optimizer state for {meta['world_size']} ranks' parameter "
                f"parts; this run has {par.world_size}: resume with the same world size")
        state = torch.load(folder / f"optimizer.rank{par.rank:05d}.pt", weights_only=False)
    views = trainer.sharding.dtensors(trainer.policy)
    dcp.load({"trainable": views}, checkpoint_id=str(folder / "sharded"),
             process_group=par.group)
    if state is not None:
        trainer.optimizer.load_state_dict(state)


def load_into(trainer, path) -> Path:
    """Load a checkpoint (see ``latest_checkpoint``) into ``trainer``: its policy's trainable
    parameters, the reference copy, the optimizer, the random states and the step count."""
    from safetensors.torch import load_file

    folder = latest_checkpoint(path)
    meta = json.loads((folder / "trainer.json").read_text())
    if meta.get("format") != _FORMAT:
        raise ValueError(f"{folder}: checkpoint format {meta.get('format')}, this version "
                         f"reads {_FORMAT}")
    params = dict(trainer.policy.named_parameters())
    shapes = full_shapes(trainer.policy)
    want = {n: list(shapes[n]) for n in trainer.trainable}
    if meta["trainable"] != want:
        missing = sorted(set(meta["trainable"]) ^ set(want))[:5]
        raise ValueError(f"{folder} was saved from a policy with other trainable parameters "
                         f"(differing names or shapes, e.g. {missing}); build the same policy "
                         "(model, LoRA config) before loading")
    if bool(meta.get("sharded")) != (trainer.sharding is not None):
        raise ValueError(
            f"{folder} was saved {'with' if meta.get('sharded') else 'without'} "
            "parallel='fsdp' (sharded parameters); load it into a trainer built the same way")
    if trainer.sharding is not None:
        _load_sharded(trainer, folder, meta)
    else:
        saved = load_file(str(folder / "trainable.safetensors"))
        with torch.no_grad():
            for n in trainer.trainable:
                params[n].copy_(saved[n])
    if (folder / "reference.safetensors").is_file() and trainer.reference is not None:
        weights = trainer.reference.weights
        for n, t in load_file(str(folder / "reference.safetensors")).items():
            weights[n] = t.to(weights[n].device)
    if trainer.optimizer is not None and trainer.sharding is None:
        if not (folder / "optimizer.pt").is_file():
            raise ValueError(f"{folder} holds no optimizer state (saved without an optimizer)")
        trainer.optimizer.load_state_dict(torch.load(folder / "optimizer.pt",
                                                     weights_only=False))
    rng = torch.load(folder / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    trainer.step_count = int(meta["step"])
    return folder
