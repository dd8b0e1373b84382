"""The import path ``leancompile.passes.flash_overlap`` of earlier releases: the FlashOverlap
pass now lives in ``passes/flash/`` (``driver.py``: ``flash_overlap_pass``;
``all_gather_rewrite.py``, ``reduce_scatter_rewrite.py``: the rewrites)."""

from .flash.all_gather_rewrite import rewrite_all_gather
from .flash.driver import (AUTO_KEPT_REASON, NAME, ON_ERROR_ENV, VERSION, flash_overlap_pass,
                           on_error)
from .flash.reduce_scatter_rewrite import rewrite_reduce_scatter
from .flash.splice import SITE_META

__all__ = ["flash_overlap_pass", "rewrite_all_gather", "rewrite_reduce_scatter", "NAME",
           "VERSION", "SITE_META", "AUTO_KEPT_REASON", "ON_ERROR_ENV", "on_error"]
