"""A graph's structure kept aside cheaply, and rebuilt only when someone needs it.

A report keeps each graph as it was before and after the passes, and FlashOverlap keeps the
graph it started from so that it can put it back when a site's rewrite fails. Copying an FX
graph node by node (``Graph.graph_copy``, ``copy.deepcopy``) builds a whole new graph: names
checked against a namespace, nodes linked in, arguments re-mapped; on the 150-node graphs of a
transformer block that was an eighth of the pipeline's own time, for copies that are almost
never read. ``Structure`` records each node as a tuple (name, op, target, arguments with the
nodes they read named, type, a shallow copy of its metadata): about a tenth of the cost.
``graph()`` builds a graph from it when one is wanted (``explain``, the simulator) and
``restore(graph)`` puts it back into an existing graph object.

Metadata values (``meta["val"]`` fake tensors and the like) are shared with the live graph, as
``graph_copy`` shares them; the dicts are copied, so a pass adding a key to a node's ``meta``
does not change the copy.
"""

from __future__ import annotations

import copy

import torch.fx as fx
from torch.fx.node import map_aggregate, map_arg

__all__ = ["Structure"]


class _Ref:
    """A node argument in a ``Structure``: the name of the node it read."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


def _ref(node: fx.Node) -> _Ref:
    return _Ref(node.name)


class Structure:
    """The nodes of ``graph`` as they are now (see the module docstring)."""

    __slots__ = ("_nodes", "_codegen", "_tracer_cls")

    def __init__(self, graph: fx.Graph):
        self._nodes = [(n.name, n.op, n.target, map_arg(n.args, _ref), map_arg(n.kwargs, _ref),
                        n.type, dict(n.meta)) for n in graph.nodes]
        self._codegen = graph._codegen  # how the code is printed: copied when rebuilt
        self._tracer_cls = getattr(graph, "_tracer_cls", None)

    def graph(self) -> fx.Graph:
        """A new graph with these nodes, names and metadata."""
        graph = fx.Graph(tracer_cls=self._tracer_cls)
        self._fill(graph)
        graph._codegen = copy.deepcopy(self._codegen)
        return graph

    def restore(self, graph: fx.Graph) -> None:
        """Replace every node of ``graph`` (the same object: a compiler may hold it) by these
        nodes, with their original names."""
        from torch.fx.graph import _Namespace

        for node in reversed(list(graph.nodes)):
            graph.erase_node(node)
        graph._graph_namespace = _Namespace()
        self._fill(graph)

    def _fill(self, graph: fx.Graph) -> None:
        made: dict[str, fx.Node] = {}

        def node_of(ref):
            return made[ref.name] if isinstance(ref, _Ref) else ref

        for name, op, target, args, kwargs, type_expr, meta in self._nodes:
            node = graph.create_node(op, target, map_aggregate(args, node_of),
                                     map_aggregate(kwargs, node_of), name=name,
                                     type_expr=type_expr)
            if node.name != name:
                raise AssertionError(f"rebuilding a graph renamed {name} to {node.name}")
            node.meta = dict(meta)
            made[name] = node

