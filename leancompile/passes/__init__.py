"""FX graph passes, one per module; the registry below is the order they run in.

Each pass is a plain function ``<name>_pass(gm, options) -> PassResult`` over a post-grad graph (the
forward, backward or inference graph AOTAutograd hands to the compiler). The graph contract
every pass keeps is in ``passes/README.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import (bucket_collectives, canonicalize, flash_overlap, gather_at_use, lean_grpo,
               prefetch_gathers)
from .bucket_collectives import bucket_collectives_pass
from .gather_at_use import gather_at_use_pass
from .canonicalize import canonicalize_pass
from .flash import driver as flash_driver
from .flash.driver import flash_overlap_pass
from .lean_grpo import lean_grpo_pass
from .prefetch_gathers import prefetch_gathers_pass
from .result import PassResult, Site

__all__ = ["PassSpec", "PASSES", "pass_names", "inductor_config_patches", "inductor_patches",
           "issues_ahead", "canonicalize_pass", "flash_overlap_pass", "lean_grpo_pass",
           "prefetch_gathers_pass", "gather_at_use_pass", "bucket_collectives_pass",
           "PassResult", "Site", "flash_overlap"]
# (flash_overlap: the old import path of flash/, readable as leancompile.passes.flash_overlap
# as before)


@dataclass(frozen=True, kw_only=True)
class PassSpec:
    """A named pass: the function ``fn(gm, options) -> PassResult`` (``options`` is the
    pipeline's ``CompileOptions``), a version that goes into the compile cache key, and a line
    saying what it does."""

    name: str
    fn: Callable[..., PassResult]
    version: int
    doc: str
    module_file: str
    active: Callable[..., bool] = lambda options: True
    """Whether the options turn the pass on (an opt-in pass that is off is reported as
    disabled and not run)."""

    def runs(self, options) -> bool:
        """Whether a pipeline with ``options`` runs this pass: on, and not ``disable``d."""
        return self.name not in options.disable and self.active(options)


# Order matters: canonicalisation first, so every later matcher sees one spelling.
PASSES: tuple[PassSpec, ...] = (
    PassSpec(name=canonicalize.NAME, fn=canonicalize_pass, version=canonicalize.VERSION,
             doc="views to reshape, dead pure code dropped", module_file=canonicalize.__file__),
    # Before FlashOverlap: it reads the forward graph's rows as the model computes them.
    PassSpec(name=lean_grpo.NAME, fn=lean_grpo_pass, version=lean_grpo.VERSION,
             doc="LeanGRPO (schedule=...): which outputs and saved tensors of a wrapped step "
                 "an update can reuse, row by row", module_file=lean_grpo.__file__,
             active=lambda options: options.schedule is not None),
    PassSpec(name=flash_driver.NAME, fn=flash_overlap_pass, version=flash_driver.VERSION,
             doc="FlashOverlap (overlap='flash'|'slice'): collectives around matmuls to P2P "
                 "schedules", module_file=flash_driver.__file__,
             active=lambda options: options.overlap is not None),
    # After FlashOverlap: it issues ahead the parameter gathers FlashOverlap left (a 2-D
    # mesh's FSDP weight gathers beside decomposed TP collectives). Not with gather_at_use,
    # whose buckets are issued one bucket ahead instead.
    PassSpec(name=prefetch_gathers.NAME, fn=prefetch_gathers_pass,
             version=prefetch_gathers.VERSION,
             doc="prefetched gathers (with overlap=): each parameter all-gather left issued "
                 "right after the previous one of its group is waited on",
             module_file=prefetch_gathers.__file__,
             active=lambda options: options.overlap is not None and not options.gather_at_use),
    # After FlashOverlap (its schedules stay where they are), before the buckets (they then
    # follow the order of use).
    PassSpec(name=gather_at_use.NAME, fn=gather_at_use_pass, version=gather_at_use.VERSION,
             doc="gathers at use (gather_at_use=True): each parameter's all-gather moved to "
                 "where the gathered weight is first read", module_file=gather_at_use.__file__,
             active=lambda options: options.gather_at_use),
    # After FlashOverlap: it buckets the collectives FlashOverlap left as they were.
    PassSpec(name=bucket_collectives.NAME, fn=bucket_collectives_pass,
             version=bucket_collectives.VERSION,
             doc="bucketed collectives (bucket_cap_mb=...): consecutive all-gathers or "
                 "reduce-scatters of one group merged into one",
             module_file=bucket_collectives.__file__,
             active=lambda options: options.bucket_cap_mb is not None),
)


def pass_names() -> tuple[str, ...]:
    return tuple(spec.name for spec in PASSES)


def _runs(name: str, options) -> bool:
    return next(s for s in PASSES if s.name == name).runs(options)


def inductor_config_patches(options) -> dict:
    """The Inductor settings under which what the passes arrange survives Inductor's
    scheduling, for a compile with ``options`` where any graph may need them
    (``install()`` sets them while installed): ``reorder_for_peak_memory`` off where a pass
    issues collectives ahead of their use (``prefetch_gathers``; buckets after
    ``gather_at_use``). That reordering (on by default in torch 2.13) moves every collective
    down to right before its wait, to allocate its output late, which undoes any issuing
    ahead; torchtitan's graph_trainer turns it off for the same reason. The overlap schedules'
    own order does not depend on it (``runtime/p2p.py``: their waits depend on the compute they
    overlap). ``backend()`` and ``lean_compile`` turn it off per graph instead, only for the
    graphs ``issues_ahead`` finds."""
    ahead = _runs(prefetch_gathers.NAME, options) or (
        options.gather_at_use and _runs(bucket_collectives.NAME, options))
    return {"reorder_for_peak_memory": False} if ahead else {}


def issues_ahead(gm, options) -> bool:
    """Whether ``gm`` (after the passes) issues a collective ahead of its use on purpose: a
    gather ``prefetch_gathers`` placed one ahead (moved, or found in place), or a bucket
    issued one ahead after ``gather_at_use``."""
    for node in gm.graph.nodes:
        if prefetch_gathers.META_KEY in node.meta:
            return True
        if options.gather_at_use and node.target is bucket_collectives.ALL_GATHER and \
                bucket_collectives.META_KEY in node.meta:
            return True
    return False


def inductor_patches(graph_pass) -> dict:
    """Inductor config patches for a compile running ``graph_pass`` (a
    ``compiler.LeanGraphPass``): the pass in Inductor's custom slot, and
    ``reorder_for_peak_memory`` at its current value, so that a graph that turns it off
    (``issues_ahead``; ``LeanGraphPass.tunes_inductor``) does so for its own compile only."""
    import torch

    graph_pass.tunes_inductor = True
    return {"post_grad_custom_pre_pass": graph_pass,
            "reorder_for_peak_memory": torch._inductor.config.reorder_for_peak_memory}
