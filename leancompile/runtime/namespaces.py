"""The op namespaces of communication, one definition for the package (runtime is its lowest
layer, so passes, the pipeline and the trainer all read them from here). Two meanings, two
names:

- ``COLLECTIVE_NAMESPACES``: functional collectives (and their waits), what every rank must
  issue: ``_c10d_functional`` (what ``torch.distributed._functional_collectives`` and DTensor
  trace to), ``c10d_functional`` (its older spelling) and ``_c10d_functional_autograd`` (the
  versions with a backward). What the strict check, the coalesced-sync transform and the
  vmap rules look for.
- ``COMMUNICATION_NAMESPACES``: those and this package's own ops (``leancompile::``: the
  FlashOverlap P2P steps and probes of ``p2p.py``, the batched all-to-all of ``vmap_ops.py``),
  which a pass must not move or drop either. It is the whole ``leancompile`` namespace, so the
  batched attention backward of ``vmap_ops.py`` counts too: kept in place, which is safe.

A third set, ``ANY_COLLECTIVE_NAMESPACES``, adds the namespaces of graphs before
functionalization (``c10d``: in-place collectives; ``_dtensor``: DTensor's own ops), for
questions asked of any graph (is this node a collective at all?); ``ANY_COMMUNICATION_NAMESPACES``
is all of them.
"""

__all__ = ["ANY_COLLECTIVE_NAMESPACES", "ANY_COMMUNICATION_NAMESPACES", "COLLECTIVE_NAMESPACES",
           "COMMUNICATION_NAMESPACES"]

COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
"""Functional collectives and their waits."""

COMMUNICATION_NAMESPACES = COLLECTIVE_NAMESPACES + ("leancompile",)
"""Functional collectives, their waits, and this package's point-to-point steps, probes and
all-to-all (the ``leancompile`` namespace)."""

ANY_COLLECTIVE_NAMESPACES = COLLECTIVE_NAMESPACES + ("c10d", "_dtensor")
"""Collectives in any graph: functional ones, in-place ``c10d`` ones and DTensor's ops."""

ANY_COMMUNICATION_NAMESPACES = COMMUNICATION_NAMESPACES + ("c10d", "_dtensor")
"""Both: what no pass moves a collective across (functional collectives are not marked impure
in FX, so a purity check alone would let them be crossed)."""
