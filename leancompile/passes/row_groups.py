"""The process groups whose ranks hold the same rows (sequence parallelism), declared by
``parallelize_ulysses``: over them a collective along dim 0 keeps each sample's entries with
that sample (``row_lifted.py``); over any other group it mixes rows.
"""

from __future__ import annotations

from collections import Counter

import torch

from ..runtime.namespaces import ANY_COLLECTIVE_NAMESPACES

__all__ = ["declare_same_rows", "forget_same_rows", "same_rows_groups", "collective_ops",
           "is_collective"]

_SAME_ROWS: Counter = Counter()


def _group_name(group) -> str:
    return group if isinstance(group, str) else group.group_name


def declare_same_rows(group) -> None:
    """Declare that every rank of ``group`` (a process group or its ``group_name``) runs the
    same samples in the same order, as the ranks of a sequence-parallel group do
    (``parallelize_ulysses`` declares its group, ``SequenceParallel.undo`` forgets it). Only
    over such a group does an exchange or gather of whole pieces of dim 0 keep each sample's
    entries with that sample; over any other group (data parallelism: each rank its own
    samples) it is ``Mixed``. Declarations are counted: ``forget_same_rows`` undoes one."""
    _SAME_ROWS[_group_name(group)] += 1


def forget_same_rows(group) -> None:
    """Undo one ``declare_same_rows(group)``."""
    name = _group_name(group)
    _SAME_ROWS[name] -= 1
    if _SAME_ROWS[name] <= 0:
        del _SAME_ROWS[name]


def same_rows_groups() -> frozenset[str]:
    """The names of the groups declared with ``declare_same_rows`` (and not forgotten)."""
    return frozenset(_SAME_ROWS)


def collective_ops():
    """Functional collectives over dim 0 that a ``Lifted`` tensor (``row_lifted.py``) may pass:
    (exchange or gather ops with their group name's argument index, their wait)."""
    ops = getattr(torch.ops, "_c10d_functional", None)
    if ops is None:
        return {}, ()
    return {ops.all_to_all_single.default: 3, ops.all_gather_into_tensor.default: 2}, \
        (ops.wait_tensor.default,)


def is_collective(target) -> bool:
    return getattr(target, "namespace", None) in ANY_COLLECTIVE_NAMESPACES
