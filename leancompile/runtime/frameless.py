"""Run an aten graph without a Python frame per op (the ``aot_eager`` graphs of the LeanGRPO
runtime).

An fx ``GraphModule`` of aten ops calls ``torch.ops.aten.mm.default(a, b)``: an ``OpOverload``,
whose ``__call__`` is a Python function that calls the C++ op. So every op of the graph pushes
and pops a Python frame. On CPython 3.11 that can cost a system call pair per op: frames live in
a per-thread stack of chunks, a frame that does not fit in the current chunk gets a new one from
``mmap``, and popping it hands the chunk back with ``munmap``. When the graph's own frame ends
just short of its chunk's end, which depends only on how deep the caller's stack is, every
op's frame crosses the boundary. Measured with ``leancompile demo grpo`` (tiny FLUX,
``aot_eager``): reweight's vectorised backward took 0.155 s a step when the demo was started
through the ``leancompile`` script and 0.094 s through ``python -m leancompile.cli``; with
``perf record -e syscalls:sys_enter_munmap`` 99.9% of the ``munmap`` calls came from
``_PyThreadState_PopFrame``, and ``malloc`` settings changed nothing.

:func:`frameless` gives a copy of the graph module whose calls go straight to the C++ op
(``functools.partial`` of ``OpOverload._op``: called from C, no Python frame), so a graph run
pushes no frame per op wherever the caller's stack ends. Same ops, same arguments, same
dispatch (modes and subclasses are handled inside the C++ op), bitwise the same results::

    before:  mm = torch.ops.aten.mm.default(x, w)
    after:   mm = aten_mm_default(x, w)      # partial(torch.ops.aten.mm.default._op)

Only plain ``OpOverload`` targets change (not higher-order ops, TorchBind ops or Python
functions). The input graph module is left as it is (reports and analyses keep reading it).
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import fx

__all__ = ["frameless"]

_CALLERS: dict = {}


def _caller(op: torch._ops.OpOverload):
    caller = _CALLERS.get(op)
    if caller is None:
        caller = functools.partial(op._op)
        # fx names a global after the target; a partial has no name of its own.
        caller.__name__ = caller.__qualname__ = f"{op._opname}_{op._overloadname}"
        caller.__module__ = op.namespace
        _CALLERS[op] = caller
    return caller


def frameless(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose ``OpOverload`` calls skip the Python ``__call__`` frame (module
    docstring). Returns ``gm`` itself when it has no such call."""
    if not any(n.op == "call_function" and type(n.target) is torch._ops.OpOverload
               for n in gm.graph.nodes):
        return gm
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)  # pytree in/out specs of make_fx graphs
    graph.output(graph.graph_copy(gm.graph, {}))  # graph_copy returns the output's argument
    for node in graph.nodes:
        if node.op == "call_function" and type(node.target) is torch._ops.OpOverload:
            node.target = _caller(node.target)
    out = fx.GraphModule(gm, graph)
    out.meta = copy.copy(gm.meta)
    return out
