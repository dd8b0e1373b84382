"""The import path ``leancompile.passes.flash_graph`` of earlier releases: the FlashOverlap
graph-splicing tools now live in ``passes/flash/splice.py`` (``not_scattered`` in
``passes/flash/reduce_scatter_match.py``, ``node_val`` in ``runtime/fx_values.py``)."""

from ..runtime.fx_values import node_val
from .flash.reduce_scatter_match import not_scattered
from .flash.splice import (SITE_META, Unsupported, detach_metadata_readers, erase_if_dead,
                           feed_moved_readers, hoist, inline, raw_sizes_bound_later, trace,
                           users_before)

__all__ = ["SITE_META", "Unsupported", "detach_metadata_readers", "erase_if_dead",
           "feed_moved_readers", "hoist", "inline", "node_val", "not_scattered",
           "raw_sizes_bound_later", "trace", "users_before"]
