"""The import path ``leancompile.passes.flash_overlap_match`` of earlier releases: the
FlashOverlap matchers now live in ``passes/flash/`` (``all_gather_match.py``,
``reduce_scatter_match.py``; the op sets and shared helpers in ``vocabulary.py``)."""

from .flash.all_gather_match import AllGatherMatch, MatmulUse, find_all_gather_matches
from .flash.reduce_scatter_match import ReduceScatterMatch, find_reduce_scatter_matches
from .flash.vocabulary import (AG_SITE, METADATA, RESHAPES, RS_SITE, SAME_LAYOUT, Skip,
                               descendants, describe, find_sites, is_backward_graph, only_wait,
                               reshape_groups, same_shape, shape_of)

__all__ = ["AG_SITE", "RS_SITE", "AllGatherMatch", "MatmulUse", "ReduceScatterMatch",
           "find_all_gather_matches", "find_reduce_scatter_matches", "is_backward_graph",
           "METADATA", "RESHAPES", "SAME_LAYOUT", "Skip", "descendants", "describe",
           "find_sites", "only_wait", "reshape_groups", "same_shape", "shape_of"]
