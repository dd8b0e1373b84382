"""Bucketed collectives: consecutive all-gathers (or reduce-scatters) of one process group merged
into one collective over a flat buffer, up to a size cap (``CompileOptions(bucket_cap_mb=...)``).

A sharded data-parallel step (``parallel="fsdp"``, SimpleFSDP-style parametrizations, any
model whose parameters are gathered inside the traced graph) gathers every parameter with
its own all-gather in the forward and reduce-scatters every gradient with its own
reduce-scatter in the backward: hundreds of small collectives per step, each paying the
backend's fixed latency. This pass packs them into buckets, as ``DistributedDataParallel``
packs its all-reduces (``bucket_cap_mb``) and FSDP2 its per-module gathers.

All-gathers, before (two parameters' parts ``[a, k]`` and ``[b]``; ``R`` ranks)::

    g1 = all_gather_into_tensor(p1, R, group);  w1 = wait_tensor(g1)    # [R*a, k]
    g2 = all_gather_into_tensor(p2, R, group);  w2 = wait_tensor(g2)    # [R*b]
    ... reads w1 ... reads w2 ...

After (one gather of the parts laid end to end; each rank's block holds its parts)::

    flat = cat([reshape(p1, [a*k]), reshape(p2, [b])])                 # [a*k + b]
    g = all_gather_into_tensor(flat, R, group);  w = wait_tensor(g)     # [R*(a*k + b)]
    blocks = reshape(w, [R, a*k + b])
    w1 = _unsafe_view(clone(slice(blocks, 1, 0, a*k)), [R*a, k])        # rank-major, as before
    w2 = _unsafe_view(clone(slice(blocks, 1, a*k, a*k + b)), [R*b])
    ... reads w1 ... reads w2 ...

Reduce-scatters, before (two full gradients ``[R*a, k]`` and ``[R*b]``)::

    r1 = reduce_scatter_tensor(d1, "sum", R, group);  s1 = wait_tensor(r1)   # [a, k]
    r2 = reduce_scatter_tensor(d2, "sum", R, group);  s2 = wait_tensor(r2)   # [b]

After (each rank's rows of every gradient next to each other, one reduce-scatter)::

    flat = reshape(cat([reshape(d1, [R, a*k]), reshape(d2, [R, b])], 1), [R*(a*k + b)])
    r = reduce_scatter_tensor(flat, "sum", R, group);  s = wait_tensor(r)    # [a*k + b]
    s1 = reshape(slice(s, 0, 0, a*k), [a, k])      # a graph output: _unsafe_view(clone(...))
    s2 = reshape(slice(s, 0, a*k, a*k + b), [b])

Why it is legal: ``all_gather_into_tensor`` concatenates the ranks' inputs along dim 0 and
``reduce_scatter_tensor`` gives rank ``r`` the reduction of block ``r`` of dim 0; laying each
member's per-rank block side by side inside one rank block moves no element to another rank
and sums the same operands element by element. Every rank holds the same graph (up to rank
numbers), finds the same buckets and issues them in the same order. The gathered results are
copies; the reduced results are views of the bucket's buffer where the graph reads them and
tensors of their own where it returns them (as the collectives' results were: AOTAutograd
told the compiled function's callers that its outputs are not views).

Where each bucket goes: its collective where its first member was issued (or right after the
last of its inputs is computed, if later), its wait and the unpacking right before the first
read of any member's result (between the two, an asynchronous backend overlaps the transfer
with the graph's compute). A gathered bucket's full tensors live from its collective to their
last reader, so no bucket is issued earlier than its first member was, with one exception:
after ``gather_at_use`` (``CompileOptions(gather_at_use=True)``), which puts each parameter's
gather at its first reader, a gathered bucket is issued right after the previous gathered
bucket of its group is unpacked (or after a later input), one bucket ahead as FSDP2
prefetches: while one bucket's layers compute, the next bucket's transfer runs, and no more
than two buckets are gathered at once (under Inductor such a graph is compiled with
``reorder_for_peak_memory`` off, which would issue each bucket at its wait:
``passes.issues_ahead``). It never goes above a collective or another node with an
effect that came before its first member (the graph's communication keeps its order), nor
above its inputs (a cast computed at its use keeps the bucket there). A collective joins the
open bucket of its kind, process group, dtype and reduction only if its input exists before
that bucket's first read (an input computed later, such as a cast of the parameter just before
its own gather, is moved up when it is a pure op of at most two steps over values that exist
there) and the bucket stays within the cap; otherwise the bucket is closed and a new one opened.
Found separately from rewritten (``find_buckets``); every collective left alone is reported
with its reason (alone in its bucket, a symbolic size, a result read before its wait).

Numerics: gathers are bitwise. A reduce-scatter of a larger buffer may take another algorithm
in the backend (gloo and NCCL choose by message size), so with more than two ranks the order
in which the ranks' values are summed can differ: the results agree to rounding, not bit for
bit, which is why the pass is opt-in (the contract's rule 6).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..runtime.fx_values import node_val
from .flash.splice import SITE_META
from .result import PassResult, Site, format_bytes, is_pure_op, recompile

__all__ = ["bucket_collectives_pass", "find_buckets", "move_inputs_up", "rewrite_bucket", "Bucket",
           "VERSION", "NAME", "META_KEY", "merged_counts"]

NAME = "bucket_collectives"
VERSION = 3

_c10d = torch.ops._c10d_functional
aten = torch.ops.aten
ALL_GATHER = _c10d.all_gather_into_tensor.default
REDUCE_SCATTER = _c10d.reduce_scatter_tensor.default
WAIT = _c10d.wait_tensor.default
_KINDS = {ALL_GATHER: "all_gather", REDUCE_SCATTER: "reduce_scatter"}
_HOIST_DEPTH = 2
META_KEY = "leancompile_bucket"
"""``meta`` key of a bucket's collective: what it merged (``Bucket.describe``)."""


@dataclass
class _Member:
    collective: fx.Node
    waits: list[fx.Node]
    input: fx.Node
    numel: int
    """Elements of one rank's block: the gather's input, the reduction's output."""
    nbytes: int
    """Bytes the collective's input holds."""


@dataclass
class Bucket:
    """Collectives of one kind, group, dtype and reduction merged into one."""

    kind: str
    """``"all_gather"`` or ``"reduce_scatter"``."""
    key: tuple
    members: list[_Member] = field(default_factory=list)
    hoist: list[fx.Node] = field(default_factory=list)
    """Pure nodes computing members' inputs, moved up to before ``first_read``."""
    first_read: fx.Node | None = None
    """The earliest node reading any member's result."""

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.members)

    def describe(self) -> str:
        """The bucket without node names (equal buckets of two graphs read the same)."""
        group_size, group = self.key[0], self.key[1]
        what = f"{self.kind} of {len(self.members)} tensors, {format_bytes(self.nbytes)}"
        if self.kind == "reduce_scatter":
            what += f" ({self.key[4]})"
        return f"{what}, {self.key[2]}, group {group!r} of {group_size} ranks"


def _static(val) -> bool:
    return isinstance(val, torch.Tensor) and all(
        isinstance(s, int) for s in (*val.shape, *val.stride(), val.storage_offset()))


def _pure(node: fx.Node) -> bool:
    """A node that may be moved: a functional aten op with no side effect and no randomness
    (``is_pure_op``; not a tuple element, which moves with its op only)."""
    return node.target is not operator.getitem and is_pure_op(node)


def _hoistable(node: fx.Node, before: int, pos: dict, depth: int,
               planned: set) -> list[fx.Node] | None:
    """The nodes to move up (``node`` last) so that ``node`` exists before position
    ``before``; None if that needs an impure op, more than ``depth`` steps, a node another
    bucket moves (``planned``), or a node reading a collective's result (a bucketed
    collective's result is replaced by a value unpacked before its own bucket's first read,
    which may be the very node moved)."""
    if pos[node] < before:
        return []
    if depth == 0 or not _pure(node) or node in planned or any(
            arg.op == "call_function" and arg.target is WAIT for arg in node.all_input_nodes):
        return None
    moved: list[fx.Node] = []
    for arg in node.all_input_nodes:
        more = _hoistable(arg, before, pos, depth - 1, planned)
        if more is None:
            return None
        moved += [n for n in more if n not in moved]
    return moved + [node]


def _member(node: fx.Node, result: PassResult) -> tuple[_Member, tuple] | None:
    """``node`` as a bucket member and its bucket key, or None (reported) if it cannot be."""
    kind = _KINDS[node.target]
    if SITE_META in node.meta:
        result.skip(node, kind, f"a piece of the overlap pass's schedule for "
                                f"{node.meta[SITE_META]} (overlap='slice' issues its chunks as "
                                "collectives on purpose; merging them would undo the overlap)")
        return None
    inp = node.args[0]
    val = node_val(inp)
    if not isinstance(val, torch.Tensor):
        result.skip(node, kind, "its input has no recorded tensor value (meta['val'])")
        return None
    if not _static(val) or not _static(node_val(node)):
        result.skip(node, kind, "a symbolic size: buckets are laid out with static sizes",
                    local="shape")
        return None
    waits = list(node.users)
    if not waits or any(w.target is not WAIT for w in waits):
        result.skip(node, kind, "its result is read before a wait_tensor (or never waited on)")
        return None
    if kind == "all_gather":
        group_size, group = node.args[1], node.args[2]
        reduce_op = None
        numel = val.numel()
    else:
        reduce_op, group_size, group = node.args[1], node.args[2], node.args[3]
        numel = val.numel() // group_size
    key = (group_size, group, str(val.dtype), str(val.device), reduce_op)
    return _Member(collective=node, waits=waits, input=inp, numel=numel,
                   nbytes=val.numel() * val.element_size()), key


def find_buckets(gm: fx.GraphModule, cap_bytes: int, result: PassResult) -> list[Bucket]:
    """The buckets of two or more collectives ``gm`` can be rewritten into, in graph order;
    every all-gather and reduce-scatter left alone goes to ``result`` with its reason."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    open_: dict[tuple, Bucket] = {}
    closed: list[Bucket] = []
    planned: set[fx.Node] = set()  # nodes some bucket moves up
    why_alone: dict[fx.Node, str] = {}

    def close(key, reason: str) -> None:
        bucket = open_.pop(key, None)
        if bucket is None:
            return
        if len(bucket.members) > 1:
            closed.append(bucket)
        else:
            why_alone[bucket.members[0].collective] = reason

    for node in nodes:
        if node.op != "call_function" or node.target not in _KINDS:
            continue
        found = _member(node, result)
        if found is None:
            continue
        member, key = found
        kind = _KINDS[node.target]
        key = (kind, *key)
        reads = [u for w in member.waits for u in w.users]
        first_read = min(reads, key=pos.__getitem__) if reads else None
        bucket = open_.get(key)
        if bucket is not None:
            hoist = [] if bucket.first_read is None else _hoistable(
                member.input, pos[bucket.first_read], pos, _HOIST_DEPTH, planned)
            earlier = first_read is not None and bucket.first_read is not None and \
                pos[first_read] < pos[bucket.first_read]
            if bucket.nbytes + member.nbytes > cap_bytes:
                close(key, f"the next {kind} ({node.name}) would pass the cap "
                           f"({format_bytes(bucket.nbytes + member.nbytes)})")
            elif hoist is None:
                close(key, f"the next {kind}'s input ({member.input.name}) is computed after "
                           f"this bucket's result is first read ({bucket.first_read.name})")
            elif earlier and (bucket.hoist or hoist):  # moved up before a later read
                close(key, f"the next {kind} ({node.name}) is read before this bucket and a "
                           "moved input would have to move further")
            else:
                for n in hoist:  # planned: the rewrite moves them before first_read
                    bucket.hoist.append(n)
                    planned.add(n)
                    pos[n] = pos[bucket.first_read] - 0.5 + len(bucket.hoist) * 1e-6
                bucket.members.append(member)
                if bucket.first_read is None or earlier:
                    bucket.first_read = first_read
                continue
        open_[key] = Bucket(kind=kind, key=key[1:], members=[member], first_read=first_read)
        if member.nbytes > cap_bytes:
            close(key, f"it alone passes the cap ({format_bytes(member.nbytes)})")
    for key in list(open_):
        close(key, "no later collective of its kind, group and dtype to share a bucket with")
    for node, reason in why_alone.items():
        result.skip(node, _KINDS[node.target], f"alone in its bucket: {reason}")
    closed.sort(key=lambda b: pos[b.members[0].collective])
    return closed


def _add(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """A new node computing ``target(*args)`` at the graph's insertion point, its
    ``meta["val"]`` computed from the args' fake values."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    vals, kwvals = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    fakes = [v for v in torch.utils._pytree.tree_leaves((vals, kwvals))
             if isinstance(v, torch.Tensor)]
    with detect_fake_mode(fakes) or FakeTensorMode():
        node.meta["val"] = target(*vals, **kwvals)
    return node


class _Cursor:
    """Appends nodes one after another, starting after ``node`` (or before ``before``)."""

    def __init__(self, graph: fx.Graph, *, after: fx.Node | None = None,
                 before: fx.Node | None = None):
        self.graph, self.after, self.before = graph, after, before

    def __call__(self, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
        where = self.graph.inserting_before(self.before) if self.after is None else \
            self.graph.inserting_after(self.after)
        with where:
            node = _add(self.graph, target, args, kwargs)
        if self.after is not None:
            self.after = node
        return node

    def flat(self, node: fx.Node, shape: list[int]) -> fx.Node:
        """``node`` reshaped to ``shape`` (made contiguous first where its strides are not)."""
        if not node_val(node).is_contiguous():
            node = self(aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
        return self(aten.reshape.default, (node, shape))


def move_inputs_up(buckets: list[Bucket]) -> None:
    """Move every bucket's planned inputs (``Bucket.hoist``) before its first read: all
    buckets' moves before any rewrite, so that each rewrite sees the graph ``find_buckets``
    planned (a bucket may rely on a node another bucket moves up)."""
    for bucket in buckets:
        for n in bucket.hoist:
            bucket.first_read.prepend(n)


def rewrite_bucket(gm: fx.GraphModule, bucket: Bucket,
                   prefetch_after: fx.Node | None = None) -> bool:
    """Merge ``bucket``'s collectives into one (module docstring: before and after), after
    ``move_inputs_up``. The collective goes where its first member was issued (or after a
    later input), not earlier: a gather issued at the top of the graph would hold its bucket's
    full parameters from there on (every bucket at once, for parameters, which are all graph
    inputs). With ``prefetch_after`` (the end of the previous gathered bucket's unpacking,
    ``gather_at_use``), right after it instead, or after a later input: one bucket ahead.
    False (the graph unchanged) if its inputs are not all computed before its first read
    (``find_buckets`` plans so that they are)."""
    graph = gm.graph
    members = bucket.members
    pos = {n: i for i, n in enumerate(graph.nodes)}
    inputs = [m.input for m in members]
    # where its first member was issued, or later where an input is computed later
    after = max(inputs + [members[0].collective], key=pos.__getitem__)
    if prefetch_after is not None:
        # never above a collective (or another node with an effect) that came before its
        # first member: the graph's communication keeps its order
        barrier = members[0].collective.prev
        while pos[barrier] > pos[prefetch_after] and (
                barrier.op != "call_function" or _pure(barrier)):
            barrier = barrier.prev
        ahead = max(inputs + [prefetch_after, barrier], key=pos.__getitem__)
        if bucket.first_read is None or pos[ahead] < pos[bucket.first_read]:
            after = ahead
    if bucket.first_read is not None and pos[after] >= pos[bucket.first_read]:
        return False
    group_size, group = bucket.key[0], bucket.key[1]
    total = sum(m.numel for m in members)
    issue = _Cursor(graph, after=after)
    if bucket.kind == "all_gather":
        flat = issue(aten.cat.default, ([issue.flat(m.input, [m.numel]) for m in members],))
        collective = issue(ALL_GATHER, (flat, group_size, group))
    else:
        blocks = [issue.flat(m.input, [group_size, m.numel]) for m in members]
        flat = issue(aten.reshape.default, (issue(aten.cat.default, (blocks, 1)),
                                            [group_size * total]))
        collective = issue(REDUCE_SCATTER, (flat, bucket.key[4], group_size, group))
    collective.meta.update({k: v for k, v in members[0].collective.meta.items()
                            if k not in ("val", "tensor_meta")})
    collective.meta[META_KEY] = bucket.describe()
    unpack = _Cursor(graph, after=collective) if bucket.first_read is None else \
        _Cursor(graph, before=bucket.first_read)
    wait = unpack(WAIT, (collective,))
    if bucket.kind == "all_gather":
        rank_blocks = unpack(aten.reshape.default, (wait, [group_size, total]))
    offset = 0
    for m in members:
        shape = list(node_val(m.waits[0]).shape)
        if bucket.kind == "all_gather":  # rank-major again: a copy
            part = unpack(aten.slice.Tensor, (rank_blocks, 1, offset, offset + m.numel))
            part = unpack(aten.clone.default, (part,), {"memory_format": torch.contiguous_format})
            copied = True
        elif any(u.op == "output" for w in m.waits for u in w.users):
            # Returned: a tensor of its own, as the collective's result was. Not a view of the
            # bucket's buffer: the compiled function's callers were told its outputs are not
            # views, and a gradient returned for two parameters (the graph's CSE merges equal
            # reductions) as two views of one region would become two .grad tensors sharing
            # memory. slice_copy, not clone of a slice: Inductor drops such a clone (same
            # sizes and strides) and returns views.
            part = unpack(aten.slice_copy.Tensor, (wait, 0, offset, offset + m.numel))
            copied = True
        else:  # read inside the graph only: a view of this rank's block
            part = unpack(aten.slice.Tensor, (wait, 0, offset, offset + m.numel))
            copied = False
        if copied:
            value = unpack(aten._unsafe_view.default, (part, shape))
        else:
            value = unpack(aten.reshape.default, (part, shape))
        offset += m.numel
        for w in m.waits:
            w.replace_all_uses_with(value)
            graph.erase_node(w)
        graph.erase_node(m.collective)
    return True


def merged_counts(result: PassResult) -> dict[str, tuple[int, int]]:
    """{kind: (collectives merged, buckets they became)} from this pass's result."""
    out: dict[str, tuple[int, int]] = {}
    for kind in _KINDS.values():
        sites = [s.kind for s in result.rewritten if s.kind.startswith(f"{kind} into bucket ")]
        if sites:
            out[kind] = (len(sites), len(set(sites)))
    return out


def bucket_collectives_pass(gm: fx.GraphModule, options) -> PassResult:
    result = PassResult(name=NAME)
    cap = int(options.bucket_cap_mb * 2 ** 20)
    buckets = find_buckets(gm, cap, result)
    move_inputs_up(buckets)
    prefetch = getattr(options, "gather_at_use", False)
    unpacked: dict[tuple, fx.Node] = {}  # per key: the end of its last gathered bucket
    j = 0
    for bucket in buckets:
        sites = [(m.collective.name, str(m.collective.target)) for m in bucket.members]
        if not rewrite_bucket(gm, bucket, unpacked.get(bucket.key) if prefetch else None):
            for m in bucket.members:
                result.skip(m.collective, bucket.kind, "its bucket's inputs are not all "
                            "computed before its first read once the inputs are moved up "
                            "(left alone; please report this graph)")
            continue
        if bucket.kind == "all_gather" and bucket.first_read is not None:
            unpacked[bucket.key] = bucket.first_read.prev
        result.rewritten += [Site(node=name, kind=f"{bucket.kind} into bucket {j}",
                                  target=target) for name, target in sites]
        result.notes.append(bucket.describe())
        j += 1
    if buckets:
        gm.graph.lint()
        recompile(gm)
    return result

