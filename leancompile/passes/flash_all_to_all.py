"""The import path ``leancompile.passes.flash_all_to_all`` of earlier releases: FlashOverlap's
Ulysses all-to-all half now lives in ``passes/flash/all_to_all.py`` (the site kinds, the
``ALL_TO_ALL`` op and ``LAYOUT`` in ``vocabulary.py``, ``replay`` in ``splice.py``)."""

from .flash.all_to_all import (AllToAllMatch, AttentionMatch, find_all_to_all_matches,
                               rewrite_attention)
from .flash.splice import replay
from .flash.vocabulary import A2A_SITE, ALL_TO_ALL, ATTENTION_SITE, LAYOUT

__all__ = ["A2A_SITE", "ALL_TO_ALL", "ATTENTION_SITE", "AllToAllMatch", "AttentionMatch",
           "LAYOUT", "find_all_to_all_matches", "replay", "rewrite_attention"]
