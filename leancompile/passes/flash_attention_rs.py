"""The import path ``leancompile.passes.flash_attention_rs`` of earlier releases: the
query-split attention inside a reduce-scatter's schedule now lives in ``passes/flash/``
(``attention_match.py``: the match; ``attention_rewrite.py``: the rewrite)."""

from .flash.attention_match import ATTENTION, AttentionRowsMatch, match_attention_rows
from .flash.attention_rewrite import rewrite_attention_reduce_scatter
from .flash.vocabulary import ATTENTION_RS_SITE

__all__ = ["ATTENTION", "ATTENTION_RS_SITE", "AttentionRowsMatch", "match_attention_rows",
           "rewrite_attention_reduce_scatter"]
