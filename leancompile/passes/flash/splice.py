"""Splicing a traced schedule into a graph, the tools every FlashOverlap rewrite uses: trace a
runtime schedule into a small graph (``trace``), copy it into the pass's graph (``inline``),
move what it needs before it (``hoist``, ``users_before``), erase what it replaced
(``detach_metadata_readers``, ``erase_if_dead``), hand a moved result to the readers of the
collective's layout (``feed_moved_readers``), replay a layout chain on one piece (``replay``),
and bind the symbolic sizes a traced schedule closed over to nodes (``bind_symbolic_sizes``).

A failure to splice (a node that must move but cannot, a schedule that reads a tensor it was
not given) raises ``Unsupported``: the site stays as it was, with that reason.
"""

from __future__ import annotations

import contextlib
import operator
import warnings

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

from ..result import is_barrier
from .vocabulary import METADATA, RESHAPES, node_val, shape_of

__all__ = ["SITE_META", "Unsupported", "bind_symbolic_sizes", "detach_metadata_readers",
           "erase_if_dead", "feed_moved_readers", "hoist", "inline", "raw_sizes_bound_later",
           "replay", "trace", "users_before"]

aten = torch.ops.aten

SITE_META = "flash_overlap_site"
"""``meta`` key on every node a rewrite inserts: the name of the collective it replaced."""


class Unsupported(Exception):
    """A matched site this rewrite cannot do: it is left as it was, with this as the reason."""


def trace(fn, inputs: list) -> fx.Graph:
    """``fn`` run once over the fake values of the nodes ``inputs``, every aten and P2P op it
    dispatches recorded as a node of a new graph (placeholders for ``inputs``, an output for
    what ``fn`` returns).

    The schedules are straight-line tensor code with Python control flow over ints only, so
    one run records them whole. This is what ``make_fx`` would produce (ops below autograd, the
    composite ones such as ``reshape`` already decomposed, ``meta["val"]`` on every node) at a
    fraction of its cost, with Inductor's decompositions, like the graph it goes into (Inductor
    refuses ops it decomposes itself, e.g. ``aten.t``). SymInts computed from sizes stay raw
    values in the recorded args; the pass turns them into nodes
    (``bind_symbolic_sizes``).

    With static shapes the schedule runs on meta tensors instead of the graph's fake ones
    (``_record_on_meta``: the same graph and values at a tenth of the dispatch cost, which is
    most of the pass's compile time); symbolic shapes need the fake mode's shape environment.
    """
    from torch._guards import detect_fake_mode
    from torch._inductor.fx_passes.post_grad import remove_noop_ops
    from torch._subclasses.fake_tensor import FakeTensorMode

    values = [node_val(n) for n in inputs]
    fake_mode = detect_fake_mode(values) or FakeTensorMode()
    graph = None
    device = _static_device(values)
    if device is not None:
        try:
            graph = _record_on_meta(fn, values, fake_mode, device)
        except Unsupported:
            raise
        except Exception:  # noqa: BLE001 - an op without a meta kernel: trace under fake mode
            graph = None
    if graph is None:
        graph = _record(fn, values, values, fake_mode)
    if _has_noop_candidates(graph):
        remove_noop_ops(graph)
    graph.eliminate_dead_code()
    return graph


def _has_noop_candidates(graph: fx.Graph) -> bool:
    """Whether ``remove_noop_ops`` could remove a node of ``graph``: one of the ops it knows
    whose result has its source's sizes, strides and dtype (its first test of every node;
    checked here on the recorded values, at a tenth of its cost, since most schedules have
    none)."""
    from torch._inductor.fx_passes.post_grad import noop_registry, same_meta

    for node in graph.nodes:
        entry = noop_registry.get(node.target) if node.op == "call_function" else None
        if entry is None:
            continue
        _, src_index = entry
        try:
            src = node.args[src_index] if isinstance(src_index, int) else src_index(node.args)
        except (IndexError, TypeError):
            return True  # let remove_noop_ops decide
        if isinstance(src, fx.Node) and same_meta(node, src):
            return True
    return False


def _record(fn, values: list, args: list, context, device_map=None) -> fx.Graph:
    """Run ``fn(*args)`` under ``context`` and a ``_Recorder``: placeholders carry ``values``
    (the graph's fake values of the inputs; ``args`` are what ``fn`` actually runs on)."""
    from torch._inductor.decomposition import select_decomp_table

    graph = fx.Graph()
    recorder = _Recorder(graph, select_decomp_table(), device_map)
    for i, (value, arg) in enumerate(zip(values, args)):
        node = graph.placeholder(f"arg{i}")
        node.meta["val"] = value
        recorder.bind(arg, node)
    with torch.no_grad(), context, recorder, raw_sizes_bound_later():
        out = fn(*args)
    graph.output(recorder.node_of_tree(out))
    return graph


def _static_device(values: list):
    """The one device of ``values`` when every size and stride is a plain int (the schedule
    can then be recorded on meta tensors), else None."""
    devices = {v.device for v in values if isinstance(v, torch.Tensor)}
    if len(devices) != 1 or not all(
            isinstance(v, torch.Tensor) and not any(
                isinstance(s, torch.SymInt) for s in (*v.shape, *v.stride(),
                                                      v.storage_offset()))
            for v in values):
        return None
    return devices.pop()


def _record_on_meta(fn, values: list, fake_mode, device) -> fx.Graph:
    """``_record`` for static shapes: the schedule runs on meta tensors (a tenth of a fake
    tensor's dispatch cost; the compile-time budget of the pass is mostly this recording), then
    every recorded value becomes a fake tensor of ``fake_mode`` on ``device``, as ``make_fx``
    under the graph's fake mode would have left it. Device arguments the schedule read from its
    (meta) tensors are recorded as ``device``."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    meta = torch.device("meta")

    def on_meta(t):
        with unset_fake_temporarily():
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=meta)

    # The compiler may run the pass under its fake mode: leave it while recording, or the meta
    # tensors would be fake ones (and every op would pay the fake dispatch this avoids).
    graph = _record(fn, values, [on_meta(v) for v in values], unset_fake_temporarily(),
                    device_map={meta: device})
    converter = fake_mode.fake_tensor_converter

    def fake(t):
        if not isinstance(t, torch.Tensor) or isinstance(t, torch._subclasses.FakeTensor):
            return t
        on, t = (device, t) if t.is_meta else (t.device, on_meta(t))
        return converter.from_meta_and_device(fake_mode, t, on)

    for node in graph.nodes:
        if node.op == "call_function" and "val" in node.meta:
            val = node.meta["val"]
            node.meta["val"] = (type(val)(fake(v) for v in val) if isinstance(val, (tuple, list))
                                else fake(val))
    return graph


class _Recorder(TorchDispatchMode):
    """Records each op dispatched under it as a node of ``graph``, or the ops its entry in
    ``decompositions`` issues; tensors are mapped to the nodes that produced them by identity
    (every recorded value is kept alive, so an id is never reused while recording)."""

    def __init__(self, graph: fx.Graph, decompositions: dict, device_map=None):
        super().__init__()
        self.graph = graph
        self.decompositions = decompositions
        self.device_map = device_map or {}
        self.nodes: dict[int, fx.Node] = {}
        self.alive: list = []

    def bind(self, tensor: torch.Tensor, node: fx.Node) -> None:
        self.nodes[id(tensor)] = node
        self.alive.append(tensor)

    def node_of_tree(self, tree):
        from torch.fx.node import map_aggregate

        def node_of(value):
            if not isinstance(value, torch.Tensor):
                if isinstance(value, torch.device):
                    return self.device_map.get(value, value)
                return value
            try:
                return self.nodes[id(value)]
            except KeyError:
                raise Unsupported("the schedule read a tensor that is neither an input nor "
                                  "made by a recorded op") from None

        return map_aggregate(tree, node_of)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        decomposition = self.decompositions.get(func)
        if decomposition is not None:
            with self:
                out = decomposition(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and id(out) in self.nodes:
            # An op that hands back a tensor it was given (``to`` a dtype the tensor has, as
            # the opmath casts of Inductor's mm decomposition do) adds nothing to the graph.
            if func._schema.is_mutable:
                raise Unsupported(f"the schedule mutates a tensor in place ({func})")
            return out
        node = self.graph.call_function(func, self.node_of_tree(args), self.node_of_tree(kwargs))
        node.meta["val"] = out
        if isinstance(out, torch.Tensor):
            self.bind_result(func, out, node)
        elif isinstance(out, (tuple, list)):
            for i, item in enumerate(out):
                if isinstance(item, torch.Tensor):
                    item_node = self.graph.call_function(operator.getitem, (node, i))
                    item_node.meta["val"] = item
                    self.bind_result(func, item, item_node)
        return out

    def bind_result(self, func, tensor: torch.Tensor, node: fx.Node) -> None:
        """Bind an output of ``func`` (an item of a tuple output: a whole output that is one of
        the inputs as it is never reaches here) to ``node``; an item that is one of the inputs
        stays bound to the node that made it; the schedules mutate nothing."""
        if id(tensor) not in self.nodes:
            self.bind(tensor, node)
        elif func._schema.is_mutable:
            raise Unsupported(f"the schedule mutates a tensor in place ({func})")


@contextlib.contextmanager
def raw_sizes_bound_later():
    """Silence torch's warning about SymInt values in node args while a schedule is traced
    and copied in: the pass replaces them by nodes before it returns
    (``bind_symbolic_sizes``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Raw SymInt value")
        yield


def inline(graph: fx.Graph, sub: fx.Graph, inputs: list, before: fx.Node, site: str):
    """Copy ``sub``'s nodes into ``graph`` before ``before``, its placeholders bound to
    ``inputs``, each tagged with ``meta[SITE_META] = site``; returns the copied output
    values (a list)."""
    placeholders = [n for n in sub.nodes if n.op == "placeholder"]
    val_map = dict(zip(placeholders, inputs))
    with graph.inserting_before(before), raw_sizes_bound_later():
        out = graph.graph_copy(sub, val_map)
    for old, new in val_map.items():
        if old.op != "placeholder" and isinstance(new, fx.Node):
            new.meta[SITE_META] = site
    return list(out) if isinstance(out, (list, tuple)) else [out]


def hoist(node: fx.Node, anchor: fx.Node, order: dict) -> None:
    """Move ``node`` (and what it needs) before ``anchor`` if it comes after it. Pure nodes are
    moved (the weights' transposes, reshapes), and one kind of effect: the wait of an
    all-gather with no effect (``result.is_barrier``) between ``anchor`` and it
    (``_movable_gather``: a second weight of one schedule, gathered by FSDP after the first
    matmul). A gather issued after ``anchor`` moves up with its wait, past such nodes only, so
    the graph's collectives keep their order, and the gather is issued earlier (a prefetch);
    one issued before ``anchor`` stays, and its wait alone moves::

        y1 = mm(x, w1)                          g = all_gather(w2_r); w2 = wait(g)
        g = all_gather(w2_r); w2 = wait(g)  ->  y1 = mm(x, w1)   (the schedule, reading w2)
        y2 = mm(x, w2)                          y2 = mm(x, w2)
    """
    if not isinstance(node, fx.Node) or order[node] < order[anchor]:
        return
    gather = _movable_gather(node, anchor, order)
    if gather is not None:
        if order[gather] < order[anchor]:  # issued before: the wait alone moves up
            moving = (node,)
        else:
            moving = (gather, node)
            for arg in gather.all_input_nodes:
                hoist(arg, anchor, order)
        for moved in moving:
            anchor.prepend(moved)
            order[moved] = order[anchor] - 0.5
        return
    if node.op != "call_function" or node.is_impure():
        raise Unsupported(f"{node.name} is needed before {anchor.name} but cannot be moved")
    for arg in node.all_input_nodes:
        hoist(arg, anchor, order)
    anchor.prepend(node)
    order[node] = order[anchor] - 0.5


def _movable_gather(node: fx.Node, anchor: fx.Node, order: dict) -> fx.Node | None:
    """The all-gather ``node`` waits for, when ``node`` is its only reader's ``wait_tensor`` and
    no node from ``anchor`` to ``node`` (the gather aside) has an effect, so that moving the pair
    before ``anchor`` (or the wait alone, for a gather issued before ``anchor``) crosses no
    collective and no effect; else None."""
    if node.op != "call_function" or node.target is not _c10d.wait_tensor.default:
        return None
    gather = node.args[0]
    if (not isinstance(gather, fx.Node) or gather.target is not _c10d.all_gather_into_tensor.default
            or len(gather.users) != 1):
        return None
    between = anchor.next
    while between is not node:
        if between is not gather and is_barrier(between):
            return None
        between = between.next
    return gather


_c10d = torch.ops._c10d_functional


def detach_metadata_readers(nodes) -> None:
    """Readers of sizes and strides (``sym_size(wait, 0)`` and friends) of nodes a rewrite is
    about to erase read the value instead (the SymInt of their ``meta["val"]``, bound to the
    graph's inputs by ``bind_symbolic_sizes``, or an int): the size of a
    replaced collective is a fact of the shapes, not of the node."""
    for node in set(nodes):
        if not isinstance(node, fx.Node) or getattr(node, "_erased", False):
            continue
        for reader in list(node.users):
            if reader.op != "call_function" or reader.target not in METADATA:
                continue
            value = reader.meta.get("val")
            if not isinstance(value, (int, torch.SymInt)):
                raise RuntimeError(f"{reader.name} reads metadata of {node.name} with no "
                                   "recorded value")
            if isinstance(value, torch.SymInt) and value.node.expr.is_number:
                value = int(value.node.expr)
            for user in list(reader.users):
                user.args = fx.node.map_aggregate(user.args,
                                                  lambda a, r=reader, v=value: v if a is r else a)
                user.kwargs = fx.node.map_aggregate(
                    user.kwargs, lambda a, r=reader, v=value: v if a is r else a)
            reader.graph.erase_node(reader)


def erase_if_dead(graph: fx.Graph, nodes) -> None:
    live = [n for n in set(nodes) if not getattr(n, "_erased", False)]
    for node in sorted(live, key=lambda n: -_position(graph, n)):
        if not node.users:
            graph.erase_node(node)


def _position(graph: fx.Graph, node: fx.Node) -> int:
    for i, n in enumerate(graph.nodes):
        if n is node:
            return i
    return -1


def users_before(nodes, anchor: fx.Node, order: dict, *, stop=frozenset(),
                 what: str = "the gathered tensor") -> list[fx.Node]:
    """``nodes`` before ``anchor`` and, transitively, their users before it, in graph order,
    not following ``stop`` (nodes the rewrite replaces); they must be pure to be moved after
    the schedule."""
    found, stack = set(), [n for n in nodes if order[n] < order[anchor] and n not in stop]
    while stack:
        node = stack.pop()
        if node in found:
            continue
        if node.op != "call_function" or node.is_impure():
            raise Unsupported(f"{node.name} reads {what} before {anchor.name} "
                              "and cannot be moved after the schedule")
        found.add(node)
        stack.extend(u for u in node.users if order[u] < order[anchor] and u not in stop)
    return sorted(found, key=order.__getitem__)


def feed_moved_readers(graph: fx.Graph, match, scattered: fx.Node, out: fx.Node) -> None:
    """For a reduce-scatter ``match``: readers of the wait besides the movedim back
    (``match.scattered``; e.g. the graph output, when the partitioner saves the result in its
    moved layout) read the rewrite's result ``out`` moved back, as a contiguous tensor like the
    collective's."""
    if scattered is match.wait:
        return
    graph.erase_node(scattered)
    if not match.wait.users:
        return
    perm = list(scattered.args[1])
    with graph.inserting_after(out):
        moved = graph.call_function(aten.permute.default, (out, perm))
    with graph.inserting_after(moved):
        dense = graph.call_function(aten.clone.default, (moved,),
                                    {"memory_format": torch.contiguous_format})
    moved.meta["val"] = node_val(out).permute(perm)
    dense.meta["val"] = moved.meta["val"].contiguous()
    for node in (moved, dense):
        node.meta[SITE_META] = match.reduce_scatter.name
    match.wait.replace_all_uses_with(dense)


def replay(chain, dims, world: int, x: torch.Tensor) -> torch.Tensor:
    """``chain`` run on one of ``world`` equal pieces: reshapes get the piece's size in the
    tracked dim (``dims``, after each node): the all-to-all's query chain (``all_to_all.py``)
    and the attention-to-matmul layouts (``attention_rewrite.py``)."""
    for node, dim in zip(chain, dims):
        if node.target in RESHAPES:
            shape = list(shape_of(node))
            shape[dim] = shape[dim] // world
            x = x.reshape(shape)
        elif node.target is aten.permute.default:
            x = x.permute(list(node.args[1]))
        elif node.target is aten.transpose.int:
            x = x.transpose(*node.args[1:3])
        elif node.target is aten.clone.default:
            x = x.clone(**node.kwargs)
        else:  # alias
            x = aten.alias.default(x)
    return x


def bind_symbolic_sizes(graph: fx.Graph) -> None:
    """Replace the SymInts a traced schedule closed over (sizes read from ``meta["val"]`` of
    the original graph, e.g. ``4*s77``) by nodes that compute them from the graph's inputs.

    A graph may only name a size through a node (a SymInt placeholder, ``sym_size``); a raw
    SymInt in a node's args prints as its symbol (``s77``) and fails when the graph runs.
    Each symbol is bound to a SymInt placeholder holding it or, failing that, to
    ``aten.sym_size.int`` of a tensor placeholder with it as a dim; compound expressions are
    built from those with Python arithmetic (``torch.utils._sympy.interp.sympy_interp``).
    """
    from torch.fx.node import map_aggregate
    from torch.utils._sympy.interp import sympy_interp
    from torch.utils._sympy.reference import PythonReferenceAnalysis

    tracer = fx.proxy.GraphAppendingTracer(graph)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    env: dict = {}
    for node in placeholders:
        val = node_val(node)
        if isinstance(val, torch.SymInt) and val.node.expr.is_Symbol:
            env.setdefault(val.node.expr, fx.Proxy(node, tracer))

    def from_tensor_dim(symbol):
        for node in placeholders:
            val = node_val(node)
            if not isinstance(val, torch.Tensor):
                continue
            for dim, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt) and size.node.expr == symbol:
                    with graph.inserting_after(placeholders[-1]):
                        bound = graph.call_function(aten.sym_size.int, (node, dim))
                    bound.meta["val"] = size
                    env[symbol] = fx.Proxy(bound, tracer)
                    return env[symbol]
        raise Unsupported(f"no graph input holds the size symbol {symbol}")

    for node in list(graph.nodes):
        if node.op not in ("call_function", "output"):
            continue

        def bind(arg, node=node):
            if not isinstance(arg, torch.SymInt):
                return arg
            expr = arg.node.expr
            if expr.is_number:
                return int(expr)
            with graph.inserting_before(node):
                value = sympy_interp(PythonReferenceAnalysis, env, expr,
                                     missing_handler=from_tensor_dim)
            if isinstance(value, fx.Proxy):
                value.node.meta.setdefault("val", arg)
                _fill_size_vals(value.node)
                return value.node
            return value

        node.args = map_aggregate(node.args, bind)
        node.kwargs = map_aggregate(node.kwargs, bind)


def _fill_size_vals(node: fx.Node) -> None:
    """Give the inner nodes of a size expression built by ``bind_symbolic_sizes`` (``2 * s0``
    of ``2 * s0 * s1``) the SymInt they compute as ``meta["val"]``, as ``make_fx`` does:
    Inductor before torch 2.13 lowers Python arithmetic nodes from ``meta["val"]`` (a
    ``KeyError: 'val'`` without it)."""
    from torch.fx.node import map_arg

    for arg in node.all_input_nodes:
        if "val" not in arg.meta and arg.op == "call_function":
            _fill_size_vals(arg)
            arg.meta["val"] = arg.target(*map_arg(arg.args, lambda a: a.meta["val"]),
                                         **map_arg(arg.kwargs, lambda a: a.meta["val"]))
