"""FlashOverlap: collectives next to matmuls (and Ulysses all-to-alls around an attention)
become per-rank P2P schedules interleaved with the per-slice compute. The pass is
``flash_overlap_pass`` (``driver.py``); the schedules it traces into the graph are in
``leancompile/runtime/flash_schedules.py`` and ``runtime/a2a_schedules.py``.

The modules, each importing only from those above it:

- ``vocabulary.py``: the matcher vocabulary (site kinds, op sets, ``Skip``, ``find_sites``, the
  checks every site goes through, small graph helpers);
- ``attention_match.py``: whether a matmul's rows are an attention's query rows;
- ``all_gather_match.py``, ``reduce_scatter_match.py``: find the sites; every decision to leave
  a site alone is made here, with its reason;
- ``splice.py``: tracing a schedule and splicing it into the graph;
- ``all_gather_rewrite.py``, ``attention_rewrite.py`` (an attention split by query inside a
  reduce-scatter's schedule), ``reduce_scatter_rewrite.py``: one matched site each;
- ``all_to_all.py``: Ulysses attention split by query (find, then rewrite);
- ``driver.py``: the pass (options per site, retries after a failed rewrite, probes,
  warnings); it loops over the matches.

Old import paths (``passes/flash_overlap.py``, ``flash_overlap_match.py``, ``flash_graph.py``,
``flash_all_to_all.py``, ``flash_attention_rs.py``) re-export these names.
"""

from .all_gather_match import AllGatherMatch, MatmulUse, find_all_gather_matches
from .all_to_all import AttentionMatch, find_all_to_all_matches
from .driver import NAME, VERSION, flash_overlap_pass
from .reduce_scatter_match import ReduceScatterMatch, find_reduce_scatter_matches

__all__ = ["NAME", "VERSION", "flash_overlap_pass", "AllGatherMatch", "MatmulUse",
           "ReduceScatterMatch", "AttentionMatch", "find_all_gather_matches",
           "find_reduce_scatter_matches", "find_all_to_all_matches"]
