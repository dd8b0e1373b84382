"""FlashOverlap, the pass: all-gather -> matmul, matmul -> reduce-scatter and Ulysses
all-to-all -> attention -> all-to-all sites become per-rank P2P schedules interleaved with the
per-slice compute.

This module drives; it decides nothing about a site's form. It binds each collective's own
options (``overlap_sites``), asks the matchers for the sites (``all_gather_match.py``,
``reduce_scatter_match.py``, ``all_to_all.py``: every collective they leave alone is already in
the result with its reason), loops over the matches calling the rewrites
(``all_gather_rewrite.py``, ``reduce_scatter_rewrite.py``, ``all_to_all.py``; each docstring
shows its graph before and after, and why it is legal), and keeps the pass safe: a site whose
rewrite raises is left as it was and the others are rewritten again (``on_error``), a
collective left in place for a rank-local reason gets a probe (``runtime/p2p.py``), and a graph
where nothing was rewritten is worth one warning in the log.

Each rewrite traces the runtime schedule of this rank into the graph, so every P2P step and
every slice's matmul is a node: visible in ``explain``, kept by dead-code elimination, left
where it is by Inductor's own collective reordering.

Dynamic shapes: divisibility by ``N * chunks_per_rank`` is decided on the symbolic sizes by the
matcher. A site divisible only under a guard is rewritten in a forward (or inference) graph
after the guard is added to the shape environment (Dynamo makes it a guard of the compiled
region: sizes that fail it recompile, and the recompiled graph keeps the collective). A
backward graph adds no guard; the forward's guard usually proves its sites, the others are
skipped with the guard in the reason. Sizes the traced schedule closes over become nodes
(``splice.bind_symbolic_sizes``), as the graph must compute every symbolic size from its
inputs. Tracing a schedule over symbolic sizes also adds torch's usual size guards for narrow,
cat and reshape (such as "a chunk is not of length 1"): a recompile for such sizes, not a wrong
result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import warnings

import torch
import torch.fx as fx

from ..result import PassResult, recompile
from ..structure import Structure
from .all_to_all import find_all_to_all_matches, rewrite_attention
from .all_gather_match import claim_matmuls, find_all_gather_matches
from .reduce_scatter_match import find_reduce_scatter_matches
from .all_gather_rewrite import rewrite_all_gather
from .reduce_scatter_rewrite import rewrite_reduce_scatter
from .splice import bind_symbolic_sizes
from .vocabulary import (A2A_SITE, AG_SITE, ALL_GATHER, ALL_TO_ALL, ATTENTION_SITE,
                         REDUCE_SCATTER, RS_SITE, is_backward_graph, node_val)

__all__ = ["AUTO_KEPT_REASON", "NAME", "ON_ERROR_ENV", "VERSION", "flash_overlap_pass",
           "on_error"]

log = logging.getLogger("leancompile")

NAME = "flash_overlap"
VERSION = 8

aten = torch.ops.aten


def flash_overlap_pass(gm: fx.GraphModule, options=None) -> PassResult:
    """Rewrite every matched site for ``options.overlap`` (``"flash"`` or ``"slice"``); off
    (and reporting nothing) when ``options.overlap`` is None.

    Never an internal error: a site whose matching or rewrite raises is left as it was
    (the graph is restored from a copy taken before the pass and the other sites are rewritten
    again), reported skipped with the exception, and a warning names the pass; with
    ``on_error="raise"`` (or ``LEANCOMPILE_ON_ERROR=raise`` in the environment, as the test
    suite sets) the exception propagates instead. With ``overlap="flash"``, a collective left
    in place for a reason that may differ between ranks (its sizes, an error) gets a probe in
    front of it (``runtime/p2p.py``): a rank that rewrote the site and a rank that did not stop
    at once with an error instead of waiting for each other.
    """
    overlap = getattr(options, "overlap", None)
    if overlap is None:
        return PassResult(name=NAME)
    raise_errors = on_error(options) == "raise"
    snapshot = None if raise_errors else Structure(gm.graph)
    failed: dict[str, str] = {}
    while True:
        result = PassResult(name=NAME)
        try:
            _rewrite_graph(gm, options, result, failed, raise_errors=raise_errors)
        except _SiteError as err:
            if raise_errors or snapshot is None:
                raise
            failed[err.site] = err.message
            snapshot.restore(gm.graph)
            recompile(gm)
            continue
        break
    for site, message in failed.items():
        where = "this graph" if site == _WHOLE_GRAPH else f"the site at {site}"
        warnings.warn(f"leancompile pass {NAME!r}: rewriting {where} raised {message}; left "
                      "as it was (the compile goes on). Set on_error='raise' to see the "
                      "traceback", RuntimeWarning, stacklevel=2)
    return result


_WHOLE_GRAPH = "*"
ON_ERROR_ENV = "LEANCOMPILE_ON_ERROR"


def on_error(options) -> str:
    """``"raise"`` when ``options.on_error`` or ``$LEANCOMPILE_ON_ERROR`` says so, else
    ``"skip"``."""
    if os.environ.get(ON_ERROR_ENV, "").strip().lower() == "raise":
        return "raise"
    return getattr(options, "on_error", "skip")


class _SiteError(Exception):
    """Internal: rewriting ``site`` (a collective's node name, or ``_WHOLE_GRAPH``) raised."""

    def __init__(self, site: str, exc: BaseException):
        super().__init__(site, exc)
        self.site = site
        self.message = f"{type(exc).__name__}: {exc}"


AUTO_KEPT_REASON = ("overlap_sites leaves it as it is ('none'; overlap='auto' chooses so where "
                    "the simulator predicts the graph faster with it left to the backend)")
"""The reason of a site ``overlap_sites`` leaves as it is."""


def _rewrite_graph(gm: fx.GraphModule, options, result: PassResult, failed: dict[str, str], *,
                   raise_errors: bool) -> None:
    graph = gm.graph
    collectives = [n for n in graph.nodes if n.op == "call_function" and getattr(
        n.target, "namespace", "") == "_c10d_functional" and "wait" not in str(n.target)]
    handled = (ALL_GATHER, REDUCE_SCATTER)
    # Each collective's own options: ``options`` itself, or its ``overlap_sites`` entry.
    site_options = {n.name: options.for_site(n.name) for n in collectives}
    for node in collectives:
        mode = site_options[node.name].overlap
        if node.target is ALL_TO_ALL and mode == "slice":
            result.skip(node, A2A_SITE, "overlap='slice' has no all-to-all schedule; use "
                        "overlap='flash' for query-split Ulysses attention")
        elif node.target not in handled and node.target is not ALL_TO_ALL:
            result.skip(node, "collective", f"{node.target} is not an all-gather, "
                        "reduce-scatter or all-to-all; FlashOverlap leaves it to the backend")
    if _WHOLE_GRAPH in failed:
        _skip_all(graph, collectives, handled, result, failed[_WHOLE_GRAPH], site_options)
        _insert_probes(graph, result, site_options)
        return
    on_err = "raise" if raise_errors else "skip"
    # Dynamic shapes: a site divisible only under a guard (4*s by 8 needs s even) is rewritten
    # in a forward or inference graph after adding the guard to the shape environment (Dynamo
    # turns it into a guard of the compiled region: other sizes recompile). A backward graph
    # adds none; the forward's guard usually proves its sites, and the others are skipped.
    allow_guards = not is_backward_graph(graph)
    matches = _per_site(find_all_gather_matches, graph, result, site_options,
                        lambda m: m.all_gather, AG_SITE, allow_guards=allow_guards,
                        on_error=on_err)
    # With a weight gather among the matches: the reduce-scatter sites as the graph stands
    # (found, not rewritten; their skips are reported when they are matched again below, and
    # a site that failed once is not one); a matmul one of them would rewrite is left to it by
    # a weight gather over another group (claim_matmuls).
    scattered = {}
    if any(m.kind == "ag_weight" for m in matches):
        for rs in _per_site(find_reduce_scatter_matches, graph, PassResult(name=result.name),
                            site_options, lambda m: m.reduce_scatter, RS_SITE,
                            allow_guards=allow_guards, on_error="skip"):
            if rs.reduce_scatter.name in failed:
                continue
            for mm in {rs.matmul, *(term for term, _ in rs.terms)}:
                scattered[mm] = (rs.reduce_scatter.name, rs.group_name, rs.group_size)
    for match in claim_matmuls(matches, result, scattered):
        name = match.all_gather.name
        if name in failed:
            result.skip(match.all_gather, AG_SITE, _failed_reason(failed[name]), local="error")
            continue
        site = site_options[name]
        with _attributed(name):
            _add_guard(match.needs_guard, match.shard)
            rewrite_all_gather(gm, match, chunks_per_rank=site.flash_chunks_per_rank,
                               overlap=site.overlap, chunks=site.slice_chunks, result=result)
    for match in _per_site(find_reduce_scatter_matches, graph, result, site_options,
                           lambda m: m.reduce_scatter, RS_SITE, allow_guards=allow_guards,
                           on_error=on_err):
        name = match.reduce_scatter.name
        if name in failed:
            result.skip(match.reduce_scatter, RS_SITE, _failed_reason(failed[name]),
                        local="error")
            continue
        site = site_options[name]
        with _attributed(name):
            _add_guard(match.needs_guard, match.matmul)
            rewrite_reduce_scatter(gm, match, chunks_per_rank=site.flash_chunks_per_rank,
                                   variant=site.flash_variant, overlap=site.overlap,
                                   chunks=site.slice_chunks, result=result,
                                   split_attention=site.attention_split)
    if any(n.target is ALL_TO_ALL and site_options[n.name].overlap == "flash"
           for n in collectives):
        for site in find_all_to_all_matches(graph, result, on_error=on_err):
            name = site.query.all_to_all.name  # the query all-to-all names the site
            if site_options[name].overlap != "flash":
                for a2a in (site.query.all_to_all, site.output.all_to_all):
                    result.skip(a2a, A2A_SITE, AUTO_KEPT_REASON)
                continue
            if name in failed:
                result.skip(site.query.all_to_all, ATTENTION_SITE, _failed_reason(failed[name]),
                            local="error")
                continue
            with _attributed(name):
                rewrite_attention(gm, site, result)
    with _attributed(_WHOLE_GRAPH):
        _insert_probes(graph, result, site_options)
        if result.rewritten:
            bind_symbolic_sizes(graph)
        graph.lint()
        recompile(gm)
    candidates = [n for n in collectives if n.target in handled
                  and site_options[n.name].overlap is not None]
    if not result.rewritten and candidates:  # all-reduces alone: nothing for the pass, no noise
        log.warning("leancompile: overlap=%r rewrote none of the %d all-gathers and "
                    "reduce-scatters in this graph; see explain() for the reasons: %s",
                    options.overlap, len(candidates),
                    "; ".join(str(s) for s in result.skipped) or "none matched")


def _per_site(find, graph: fx.Graph, result: PassResult, site_options: dict, collective,
              kind: str, **kwargs) -> list:
    """``find`` (``find_all_gather_matches`` or ``find_reduce_scatter_matches``) for each
    site with the divisor of its own options: one search per divisor in use, each site's
    match (or skip) taken from the search of its own. Sites ``overlap_sites`` keeps are
    skipped with the reason. With one setting for every site this is one plain search."""
    target = ALL_GATHER if kind == AG_SITE else REDUCE_SCATTER
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is target]

    def key(o):
        return (o.flash_chunks_per_rank, "chunks_per_rank") if o.overlap == "flash" else \
            (o.slice_chunks, "chunks")
    keys = {n.name: key(site_options[n.name]) for n in nodes
            if site_options[n.name].overlap is not None}
    if len(set(keys.values())) <= 1 and len(keys) == len(nodes):  # one setting: one search
        if not keys:
            return []
        divisor, name = next(iter(keys.values()))
        return find(graph, result, divisor=divisor, divisor_name=name, **kwargs)
    found: dict[str, object] = {}
    skipped: dict[str, list] = {}
    for divisor, name in sorted(set(keys.values())):
        scratch = PassResult(name=result.name)
        for match in find(graph, scratch, divisor=divisor, divisor_name=name, **kwargs):
            if keys.get(collective(match).name) == (divisor, name):
                found[collective(match).name] = match
        for site in scratch.skipped:
            if keys.get(site.node) == (divisor, name):
                skipped.setdefault(site.node, []).append(site)
    matches = []
    for node in nodes:
        if node.name not in keys:
            result.skip(node, kind, AUTO_KEPT_REASON)
        elif node.name in found:
            matches.append(found[node.name])
        result.skipped.extend(skipped.get(node.name, []))
    return matches


def _add_guard(condition, node: fx.Node) -> None:
    """Add ``condition`` (a sympy boolean true for the traced sizes, or None) as a guard of the
    shape environment of ``node``'s fake value."""
    if condition is None:
        return
    shape_env = node_val(node).fake_mode.shape_env
    if not shape_env.evaluate_expr(condition):
        raise AssertionError(f"the guard {condition} is false for the traced sizes")


@contextlib.contextmanager
def _attributed(site: str):
    """Turn any exception but a deliberate skip into a ``_SiteError`` for ``site``."""
    try:
        yield
    except _SiteError:
        raise
    except Exception as exc:  # noqa: BLE001 - the safety net: any failure leaves the site
        raise _SiteError(site, exc) from exc


def _failed_reason(message: str) -> str:
    return (f"the rewrite raised {message}; the site was left as it was (a bug in "
            "leancompile: please report it with explain()'s output)")


def _skip_all(graph: fx.Graph, collectives, handled, result: PassResult, message: str,
              site_options: dict) -> None:
    for node in collectives:
        overlap = site_options[node.name].overlap
        if overlap is not None and (
                node.target in handled or (node.target is ALL_TO_ALL and overlap == "flash")):
            kind = (A2A_SITE if node.target is ALL_TO_ALL else
                    AG_SITE if "all_gather" in str(node.target) else RS_SITE)
            result.skip(node, kind, _failed_reason(message), local="error")


def _insert_probes(graph: fx.Graph, result: PassResult, site_options: dict) -> None:
    """A ``p2p_probe`` in front of each collective left in place for a rank-local reason
    (``Site.local``), where its own options are the FlashOverlap schedule (the sliced baseline
    runs collectives, which report mismatched sizes themselves)."""
    from ...runtime.p2p import P2P_PROBE, group_rank_and_size

    nodes = {n.name: n for n in graph.nodes}
    for i, site in enumerate(result.skipped):
        node = nodes.get(site.node)
        if not site.local or node is None or \
                getattr(site_options.get(site.node), "overlap", None) != "flash" or \
                node.target not in (
                ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL):
            continue
        x = node.args[0]
        group_name = node.args[-1]
        rank, n = group_rank_and_size(group_name)
        if n == 1 or not isinstance(x, fx.Node):
            continue
        reason = {"shape": 1, "error": 2}[site.local]
        with graph.inserting_before(node):
            probed = graph.call_function(P2P_PROBE, (x, (rank + 1) % n, (rank - 1) % n,
                                                     reason, group_name))
        val = node_val(x)
        with val.fake_mode:
            probed.meta["val"] = torch.empty_like(val)
        node.replace_input_with(x, probed)
        result.skipped[i] = dataclasses.replace(
            site, reason=site.reason + "; a probe in front of the collective checks that "
            "every rank left it in place")
