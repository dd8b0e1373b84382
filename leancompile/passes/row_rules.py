"""The op rules of the row-layout analysis (``row_layout.py``): which aten ops work on each
dim-0 entry apart, which combine entries along a dim given as an argument, which mix the batch
outright, and the helpers that read an op's dims from its node. An op is row by row only where
a rule here says so (an allowlist).
"""

from __future__ import annotations

import re

import torch
import torch.fx as fx

from ..runtime.fx_values import node_val
from .aten_ops import SPLITS, node_arg, norm_dim

__all__ = ["FILLS", "ALONG_DIM", "OVER_DIMS", "PER_ENTRY", "BATCH_MIXING", "SIZE_TYPE",
           "LOOKUPS", "MATMULS", "SPLIT_LIKE", "touches_dim0",
           "no_row_rule", "permutation", "op_label"]

aten = torch.ops.aten

FILLS = (aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format,
          aten.new_full.default, aten.new_zeros.default, aten.new_ones.default,
          aten.new_empty.default, aten.expand.default, aten.empty_strided.default,
          aten.full_like.default, aten.zeros_like.default, aten.ones_like.default,
          aten.empty_like.default, aten.scalar_tensor.default)
# Ops that move or combine entries along a dim given as an argument: along dim 0 they mix rows.
ALONG_DIM = {
    aten.cumsum.default, aten.cumprod.default, aten.cummax.default, aten.cummin.default,
    aten.logcumsumexp.default, aten.sort.default, aten.sort.stable, aten.topk.default,
    aten.flip.default, aten.roll.default, aten.gather.default,
    aten.scatter.src, aten.scatter.value, aten.scatter_add.default, aten.scatter_reduce.two,
    aten._softmax.default, aten._log_softmax.default, aten.softmax.int, aten.log_softmax.int,
    aten.index_add.default, aten.index_copy.default, aten.index_fill.int_Scalar,
    aten.argmax.default, aten.argmin.default,
    torch.ops.prims.rev.default,  # (flip, as Inductor's decompositions spell it)
}
# Reductions and normalisations that take their dims as an argument: row by row unless one of
# them is dim 0 (or none is given: all dims).
OVER_DIMS = {
    aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
    aten.var.correction, aten.var_mean.correction, aten.std.correction,
    aten.std_mean.correction, aten.prod.dim_int, aten.max.dim, aten.min.dim,
    aten.logsumexp.default, aten.linalg_vector_norm.default, aten.any.dim, aten.any.dims,
    aten.all.dim, aten.all.dims, aten.aminmax.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.unsqueeze.default, aten.select.int, aten.narrow.default, aten.diagonal.default,
    aten.unfold.default, aten.repeat_interleave.self_int, aten._fft_c2c.default,
    aten._fft_r2c.default, aten._fft_c2r.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.slice_scatter.default, aten.select_scatter.default,
    aten.diagonal_scatter.default,
}
# Ops that work on each entry of dim 0 on its own whatever their other arguments (the batch is
# dim 0 of their input: attention's and convolution's N, per-sample norms and pools).
PER_ENTRY = {
    aten.clone.default, aten.contiguous.default, aten._to_copy.default, aten.alias.default,
    aten.detach.default, aten.lift_fresh_copy.default, aten.copy.default,
    aten.convolution.default, aten.native_group_norm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._flash_attention_forward.default, aten._efficient_attention_forward.default,
    aten.avg_pool2d.default, aten.max_pool2d_with_indices.default,
    aten.avg_pool3d.default, aten.max_pool3d_with_indices.default,
    aten.upsample_nearest2d.default, aten.upsample_nearest2d.vec,
    aten.upsample_bilinear2d.default, aten.upsample_bilinear2d.vec,
    aten.upsample_nearest3d.default, aten.upsample_nearest3d.vec,
    aten.view_as_real.default, aten.view_as_complex.default, aten.real.default,
    aten.imag.default, aten.complex.default, aten.polar.default, aten.masked_fill.Scalar,
    aten.masked_fill.Tensor, aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf,
    aten.fill.Scalar, aten.fill.Tensor, aten.repeat.default,
}
BATCH_MIXING = {aten._native_batch_norm_legit_functional.default,
                 aten._native_batch_norm_legit.default, aten.native_batch_norm.default,
                 aten._native_batch_norm_legit_no_training.default,
                 aten.index_put.default, aten.arange.default,
                 aten.arange.start, aten.arange.start_step, aten.randperm.default,
                 # the source's entries go to the mask's true places in order, across rows
                 aten.masked_scatter.default}
# Schema types of size arguments (a batch-dependent size is fine there: a view's shape).
SIZE_TYPE = re.compile(r"^(Optional\[)?(List\[)?(int|bool)\]?\]?$")
LOOKUPS = {aten.index.Tensor, aten.index_select.default, aten.embedding.default}
MATMULS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2), aten.bmm.default: (0, 1),
            aten.baddbmm.default: (1, 2)}
SPLIT_LIKE = SPLITS + (aten.unbind.int, aten.chunk.default)
"""Ops that return their input's pieces along a dim as a tuple (``unbind``'s dim is argument 1,
the others' argument 2)."""


def touches_dim0(node: fx.Node, x) -> bool:
    """Whether an op's ``dim``/``dims`` argument names dim 0 of its first input."""
    ndim = len(node_val(x).shape) if isinstance(node_val(x), torch.Tensor) else 1
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return True
    for i, arg in enumerate(schema.arguments):
        if arg.name not in ("dim", "dims", "dimension", "dim1", "dim2"):
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if value is None:  # None: all dims
            return True
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(norm_dim(v, ndim) == 0 for v in values):
            return True
    return False



def no_row_rule(node: fx.Node, x) -> str:
    """Why the row rule of an op that keeps dim 0 does not apply ("" when it does): an op is
    row by row only where a rule says so (a pointwise op, an op over dims that are not dim 0,
    an op that works on each dim-0 entry on its own); anything else (an unknown or custom op,
    an FFT or scan along dim 0) may combine samples' entries without changing a shape."""
    target = node.target
    if torch.Tag.pointwise in getattr(target, "tags", ()) or target in PER_ENTRY:
        return ""
    if target in OVER_DIMS or target in ALONG_DIM:
        dims = node_arg(node, 1, "dims", None) if target is aten.roll.default else ()
        if dims == [] or (target is not aten.roll.default and touches_dim0(node, x)):
            return f"{op_label(node)} works along dim 0, the batch"
        return ""
    if target is aten.constant_pad_nd.default:
        pad = node_arg(node, 1, "pad", [])
        return f"{op_label(node)} pads dim 0" if len(pad) // 2 >= node_val(x).dim() else ""
    if target is aten.native_layer_norm.default:
        shape = node_arg(node, 1, "normalized_shape", [])
        return f"{op_label(node)} normalises over dim 0" if len(shape) >= node_val(x).dim() else ""
    return (f"{op_label(node)}: no row rule for this op (only ops known to work on each sample's "
            "entries apart are followed: an unknown op may combine samples)")


def permutation(node: fx.Node) -> list[int]:
    """The source dim of each output dim of a permute, transpose or ``t``."""
    ndim = len(node_val(node.args[0]).shape)
    if node.target is aten.permute.default:
        return [norm_dim(d, ndim) for d in node.args[1]]
    order = list(range(ndim))
    if node.target is aten.t.default:
        return order[::-1]
    a, b = (norm_dim(d, ndim) for d in node.args[1:3])
    order[a], order[b] = order[b], order[a]
    return order


def op_label(node: fx.Node) -> str:
    target = node.target
    label = str(target) if hasattr(target, "_schema") else getattr(target, "__name__", target)
    return f"{label} at {node.name}"
