"""Ops that batched Reweight's ``torch.func.vmap`` needs a batching rule for.

Reweight takes one gradient per row: the batch-1 backward graph runs under ``vmap`` over the
rows' own saved tensors. PyTorch has no batching rule for the CPU flash-attention backward
(``aten::_scaled_dot_product_flash_attention_for_cpu_backward``): vmap would fall back to a
Python loop over the rows, one attention backward each. ``leancompile::sdpa_cpu_backward`` is
the same op with a rule: the vmapped dim is folded into the attention's own batch dim (dim 0
of query, key, value, output, log-sum-exp and their gradient), one call for all rows.

Before (a batch-1 backward graph, vmapped over R rows: R calls)::

    gq, gk, gv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g_out, q, k, v, out, lse, 0.0, False, scale=s)        # q: [1, H, L, D] per row

After (``vmap_friendly`` swaps the target; under vmap: one call of batch R)::

    gq, gk, gv = leancompile.sdpa_cpu_backward(g_out, q, k, v, out, lse, 0.0, False, scale=s)

Collectives have no batching rule either, and vmap does not loop over them: it runs a
functional all-to-all once on the batched tensor's storage, rows and pieces interleaved, and
the gradients come out wrong (NaN in a probe). Ulysses sequence parallelism puts one in the
backward graph of every attention (the transpose of each forward all-to-all), exchanging
``[N, B, s, H/N, D]`` pieces over dim 0. ``leancompile::all_to_all_single`` is the all-to-all
and its wait in one op, with a rule: the vmapped dim moves behind dim 0, so each piece of dim
0 carries all the rows, one collective for all of them.

Before (per row ``t: [N, 1, s, H/N, D]``, R rows: no rule, wrong values)::

    x = _c10d_functional.all_to_all_single(t, [1, 1], [1, 1], "group")
    y = _c10d_functional.wait_tensor(x)

After (``vmap_friendly``; under vmap: one all-to-all of ``[N, R, 1, s, H/N, D]``)::

    y = leancompile.all_to_all_single(t, [1, 1], [1, 1], "group")

It is exact because every rank of the group vmaps the same rows in the same order (the ranks
of a sequence-parallel group run the same samples): row r's piece goes to row r of each peer,
as in the per-row backward. Other collectives stay as they are; ``unbatchable_collectives``
names those that would meet batched values (the caller then runs one backward per row).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .namespaces import COLLECTIVE_NAMESPACES

__all__ = ["COLLECTIVE_NAMESPACES", "VMAP_REPLACEMENTS", "agree_min", "vmap_friendly",
           "unbatchable_collectives", "dense_scatter_bases"]

_aten = torch.ops.aten


@torch.library.custom_op("leancompile::sdpa_cpu_backward", mutates_args=())
def sdpa_cpu_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
                      logsumexp: Tensor, dropout_p: float, is_causal: bool,
                      attn_mask: Tensor | None = None,
                      scale: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    gq, gk, gv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=attn_mask,
        scale=scale)
    return gq, gk, gv


@sdpa_cpu_backward.register_fake
def _(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None,
      scale=None):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _fold(t: Tensor, dim: int | None, rows: int, batch: int, rank: int) -> Tensor:
    """``t`` (``rank`` dims per row, the first the attention batch, maybe broadcast) with the
    vmapped dim (``dim``; None: not batched) folded into its dim 0."""
    t = t.unsqueeze(0) if dim is None else t.movedim(dim, 0)
    if t.dim() < rank + 1:  # a mask broadcast over the batch (and maybe the heads)
        t = t.reshape(t.shape[0], *([1] * (rank + 1 - t.dim())), *t.shape[1:])
    t = t.expand(rows, batch, *t.shape[2:])
    return t.reshape(rows * batch, *t.shape[2:])


@sdpa_cpu_backward.register_vmap
def _(info, in_dims, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
      attn_mask=None, scale=None):
    rows = info.batch_size
    dims = list(in_dims)
    q_dim = dims[1]
    batch = query.shape[0 if q_dim is None else (1 if q_dim == 0 else 0)]
    tensors = [_fold(t, d, rows, batch, t.dim() - (d is not None)) for t, d in zip(
        (grad_out, query, key, value, out, logsumexp), dims[:6])]
    mask = None if attn_mask is None else _fold(attn_mask, dims[8], rows, batch, query.dim() - (
        q_dim is not None))
    grads = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *tensors, dropout_p, is_causal, attn_mask=mask, scale=scale)
    return tuple(g.reshape(rows, batch, *g.shape[1:]) for g in grads), (0, 0, 0)


_funcol = torch.ops._c10d_functional


@torch.library.custom_op("leancompile::all_to_all_single", mutates_args=())
def all_to_all_single(input: Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], group_name: str) -> Tensor:
    out = _funcol.all_to_all_single(input, output_split_sizes, input_split_sizes, group_name)
    return _funcol.wait_tensor(out)


@all_to_all_single.register_fake
def _(input, output_split_sizes, input_split_sizes, group_name):
    return input.new_empty((sum(output_split_sizes), *input.shape[1:]))


@all_to_all_single.register_vmap
def _(info, in_dims, input, output_split_sizes, input_split_sizes, group_name):
    dim = in_dims[0]
    if dim is None:  # the same for every row: one exchange
        return all_to_all_single(input, output_split_sizes, input_split_sizes, group_name), None
    # [N, rows, ...]: piece j of dim 0 holds every row's piece j; the split sizes count
    # entries of dim 0, which keeps its size.
    pieces = input.movedim(dim, 1).contiguous()
    out = _funcol.all_to_all_single(pieces, output_split_sizes, input_split_sizes, group_name)
    return _funcol.wait_tensor(out), 1


VMAP_REPLACEMENTS = {
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        torch.ops.leancompile.sdpa_cpu_backward.default,
}
"""aten op -> the same op with a batching rule (same arguments)."""


def tensor_size(x: torch.Tensor, dim: int):
    """``x.size(dim)``: under vmap, the size of one row's tensor (``aten.sym_size.int`` has no
    batching rule; the method reads the logical shape vmap shows)."""
    return x.size(dim)


def tensor_stride(x: torch.Tensor, dim: int):
    """``x.stride(dim)``, as ``tensor_size`` (``aten.sym_stride.int``)."""
    return x.stride(dim)


def tensor_numel(x: torch.Tensor):
    """``x.numel()``, as ``tensor_size`` (``aten.sym_numel.default``)."""
    return x.numel()


SIZE_READS = {_aten.sym_size.int: tensor_size, _aten.sym_stride.int: tensor_stride,
              _aten.sym_numel.default: tensor_numel}
"""The size-reading ops a backward graph with symbolic sizes calls on its tensors (when the
batch size reaches it through a tensor, not an argument; a change of op order in the model
decides which), as the tensor methods vmap answers per row."""


def _is_collective(node) -> bool:
    """A functional collective (not its wait: it belongs to its collective) or a FlashOverlap
    P2P op."""
    if node.op != "call_function" or "wait_tensor" in str(node.target):
        return False
    namespace = getattr(node.target, "namespace", None)
    return namespace in COLLECTIVE_NAMESPACES or (namespace == "leancompile" and
                                                  "p2p" in str(node.target))


def vmap_friendly(gm) -> None:
    """Swap, in place, the ops of ``gm`` that vmap cannot batch for their twins with a rule
    (``VMAP_REPLACEMENTS``; the size reads ``SIZE_READS`` for tensor methods; a functional
    all-to-all with its single wait for ``leancompile::all_to_all_single``; views for
    reshapes, which hold whatever layout a batching rule gives)."""
    waits = (_funcol.wait_tensor.default,)
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in VMAP_REPLACEMENTS:
            node.target = VMAP_REPLACEMENTS[node.target]
        elif node.target in SIZE_READS:
            node.target = SIZE_READS[node.target]
        elif node.target is _aten.view.default:
            # A view spells the strides the trace saw; under vmap a tensor the graph computes
            # (checkpointing's recomputed attention) may come out of a batching rule in
            # another layout. reshape is the view where one exists, a copy where not.
            node.target = _aten.reshape.default
        elif node.target is _funcol.all_to_all_single.default and len(node.users) == 1 and \
                next(iter(node.users)).target in waits:
            wait = next(iter(node.users))
            node.target = torch.ops.leancompile.all_to_all_single.default
            wait.replace_all_uses_with(node)
            gm.graph.erase_node(wait)
    gm.recompile()


def unbatchable_collectives(gm, batched_inputs: set[int]) -> list[str]:
    """The collectives of ``gm`` (after ``vmap_friendly``) that would meet a batched value
    under vmap: those reached from the placeholders at ``batched_inputs``. vmap has no rule
    for them; a caller runs such a graph once per row instead."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    reached = {placeholders[i] for i in batched_inputs if i < len(placeholders)}
    found = []
    for node in gm.graph.nodes:
        if node.op == "placeholder" or not any(a in reached for a in node.all_input_nodes):
            continue
        reached.add(node)
        if _is_collective(node) and \
                node.target is not torch.ops.leancompile.all_to_all_single.default:
            found.append(f"{node.target} at {node.name}")
    return found


def agree_min(value: int, group_name: str, device) -> int:
    """The smallest ``value`` over the ranks of the group named ``group_name`` (one all-reduce
    of one integer on ``device``): the rows one vectorised backward takes, which its
    all-to-alls exchange, must be the same on every rank of their group."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_resolve_process_group(group_name))
    return int(t.item())


_SCATTERS = {
    torch.ops.aten.index_put.default, torch.ops.aten.scatter_add.default,
    torch.ops.aten.scatter.src, torch.ops.aten.scatter.value,
    torch.ops.aten.scatter_reduce.two, torch.ops.aten.index_add.default,
    torch.ops.aten.index_copy.default, torch.ops.aten.masked_scatter.default,
    torch.ops.aten.slice_scatter.default, torch.ops.aten.select_scatter.default,
    torch.ops.aten.diagonal_scatter.default, torch.ops.aten.as_strided_scatter.default,
}
"""Out-of-place ops that write into a copy of their first argument."""


def dense_scatter_bases(gm) -> int:
    """Give every scatter-like op (``_SCATTERS``) of ``gm`` whose base is an ``expand`` a
    dense copy of it, in place; returns how many. vmap's batching rule for the embedding
    backward scatters each row's gradient into ``expand(zeros[num, dim], [rows, num, dim])``;
    eager ``index_put`` copies its base first, but Inductor (torch 2.13) accumulates the rows
    into the one shared ``[num, dim]`` buffer, so every row's gradient came back as the sum of
    all rows'::

        expand = aten.expand(full, [4, 4, 16])            expand = aten.expand(full, [4, 4, 16])
        index_put = aten.index_put(expand, idx, v, True)  ->  dense = aten.clone(expand, contiguous)
                                                          index_put = aten.index_put(dense, ...)
    """
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SCATTERS or not node.args:
            continue
        base = node.args[0]
        if not (isinstance(base, torch.fx.Node) and base.op == "call_function"
                and base.target is torch.ops.aten.expand.default):
            continue
        with gm.graph.inserting_before(node):
            dense = gm.graph.call_function(torch.ops.aten.clone.default, (base,),
                                           {"memory_format": torch.contiguous_format})
        if "val" in base.meta:
            dense.meta["val"] = base.meta["val"].clone(memory_format=torch.contiguous_format)
        node.args = (dense, *node.args[1:])
        changed += 1
    if changed:
        gm.recompile()
    return changed
