"""What a pass reports: the sites it rewrote and the sites it left alone, with reasons."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass, field

from ..runtime.namespaces import ANY_COMMUNICATION_NAMESPACES, COMMUNICATION_NAMESPACES

__all__ = ["Site", "PassResult", "recompile", "recompile_deferred", "format_bytes",
           "COMMUNICATION_NAMESPACES"]

_DEFERRED = contextvars.ContextVar("leancompile_recompile_deferred", default=False)


def recompile(gm) -> None:
    """``gm.recompile()`` (the graph's Python code regenerated) after a pass changed the
    graph, unless the pipeline runs the pass: ``Pipeline.run`` regenerates the code once after
    all passes (or leaves it to a compiler that does: Inductor at the end of its post-grad
    passes); regenerating it after every pass was a third of the pipeline's own time."""
    if not _DEFERRED.get():
        gm.recompile()




def is_pure_op(node) -> bool:
    """A functional aten/prims op with no side effect and no random draw (its value depends on
    its inputs only, so it may be moved or recomputed), or an element of the tuple such an op
    returns (``getitem`` of a split)."""
    import operator

    import torch

    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        return is_pure_op(node.args[0])
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target.namespace not in ("aten", "prims") or target._schema.is_mutable:
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags


def is_barrier(node) -> bool:
    """A node no collective is moved past: a node with an effect (a collective or its wait,
    the overlap pass's point-to-point steps and probes, a mutation, a random draw, a
    higher-order op, whose subgraph may hold any of these). Arithmetic on sizes
    (``operator.mul`` of symbolic ints) and pure ops are not."""
    import torch

    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator):
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return target.namespace in ANY_COMMUNICATION_NAMESPACES or target._schema.is_mutable or \
        torch.Tag.nondeterministic_seeded in target.tags


def format_bytes(n: int) -> str:
    """``n`` bytes for a report line: ``"512 B"``, ``"1.50 MiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


@contextlib.contextmanager
def recompile_deferred():
    """Inside: ``recompile`` leaves the code to the caller."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


@dataclass(frozen=True, kw_only=True)
class Site:
    """One place in a graph a pass looked at.

    ``node`` is the name of the anchor node in the graph the pass saw (before rewriting);
    ``kind`` names the pattern (``"view->reshape"``, ``"dead code"``, ``"all_gather+mm"``);
    ``reason`` is empty for rewritten sites and says why for skipped ones.
    """

    node: str
    kind: str
    target: str = ""
    reason: str = ""
    local: str = ""
    """Why ranks could decide this site differently, for a skipped site: ``"shape"`` (the
    reason depends on this rank's sizes) or ``"error"`` (matching or rewriting it raised);
    empty when the decision follows from the program alone, which every rank shares."""

    def __str__(self) -> str:
        where = f"{self.node} ({self.target})" if self.target else self.node
        return f"{self.kind} at {where}" + (f": {self.reason}" if self.reason else "")


@dataclass(kw_only=True)
class PassResult:
    """The record one pass run leaves: rewritten sites, skipped sites (with reasons), seconds."""

    name: str
    rewritten: list[Site] = field(default_factory=list)
    skipped: list[Site] = field(default_factory=list)
    seconds: float = 0.0
    disabled: bool = False
    notes: list[str] = field(default_factory=list)
    """How a rewritten site was rewritten where that is a choice the pass made (e.g. an
    attention before a reduce-scatter not split by query, and why)."""

    def rewrite(self, node, kind: str) -> None:
        self.rewritten.append(Site(node=_name(node), kind=kind, target=_target(node)))

    def skip(self, node, kind: str, reason: str, *, local: str = "") -> None:
        if not reason:
            raise ValueError("a skipped site needs a reason")
        if local not in ("", "shape", "error"):
            raise ValueError(f"local={local!r}: use '', 'shape' or 'error'")
        self.skipped.append(Site(node=_name(node), kind=kind, target=_target(node), reason=reason,
                                 local=local))

    @property
    def changed(self) -> bool:
        return bool(self.rewritten)

    def summary(self) -> str:
        if self.disabled:
            return f"{self.name}: disabled"
        return (
            f"{self.name}: {len(self.rewritten)} rewritten, {len(self.skipped)} skipped"
            f" ({self.seconds * 1e3:.1f} ms)"
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _name(node) -> str:
    return node if isinstance(node, str) else getattr(node, "name", str(node))


def _target(node) -> str:
    target = getattr(node, "target", None)
    if target is None or isinstance(node, str):
        return ""
    if hasattr(target, "_schema") or isinstance(target, str):  # OpOverload: "aten.mm.default"
        return str(target)
    return getattr(target, "__name__", str(target))
