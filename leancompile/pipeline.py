"""The pass runner: an ordered pipeline of named passes over one post-grad graph.

``Pipeline.run(gm, phase=...)`` runs every enabled pass in order, records what each did (a
``PassResult``), the graph code before and after, and, when ``LEANCOMPILE_DEBUG=<dir>`` is set
in the environment, writes the graph before and after every pass to that folder as Python.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from pathlib import Path

import torch
import torch.fx as fx

from .report import GraphRecord, GraphSnapshot, graph_code, op_counts
from .options import OVERLAP_CANDIDATES, CompileOptions
from .passes import PASSES, PassSpec
from .passes.result import PassResult, recompile_deferred
from .runtime.namespaces import COLLECTIVE_NAMESPACES

__all__ = ["Pipeline", "DEBUG_ENV", "UnrewrittenCollectiveError", "check_all_rewritten"]

log = logging.getLogger("leancompile")

DEBUG_ENV = "LEANCOMPILE_DEBUG"
_dump_counter = itertools.count()


class Pipeline:
    """The ordered passes an option set enables. ``disable`` names were validated by
    ``CompileOptions``; disabled passes (by name, or opt-in passes the options leave off, such
    as ``flash_overlap`` without ``overlap=``) still appear in the results, marked
    ``disabled``."""

    def __init__(self, options: CompileOptions):
        self.options = options
        self.specs: tuple[PassSpec, ...] = PASSES
        log.debug("leancompile pipeline: %s", ", ".join(
            f"{s.name}{' (disabled)' if s.name in options.disable else ''}" for s in self.specs))

    def run(self, gm: fx.GraphModule, *, phase: str, graph_index: int = 0,
            recompile: bool = True) -> GraphRecord:
        """Run the passes on ``gm`` in place. The passes leave ``gm``'s Python code to this
        method: regenerated once at the end (``recompile=False``: to the caller, a compiler
        that regenerates it anyway; regenerating it after every pass was a third of the
        pipeline's own time)."""
        start = time.perf_counter()
        if self.options.overlap == "auto":
            record = self._run_auto(gm, phase=phase, graph_index=graph_index)
        else:
            record = self._run(gm, phase=phase, graph_index=graph_index)
        if recompile:
            gm.recompile()
        record.seconds = time.perf_counter() - start
        return record

    def _run(self, gm: fx.GraphModule, *, phase: str, graph_index: int) -> GraphRecord:
        before = GraphSnapshot(gm)  # code printed only if the report is read
        counts_before = op_counts(gm)
        debug_dir = os.environ.get(DEBUG_ENV)
        dump_dir = None
        if debug_dir:
            dump_dir = Path(debug_dir) / f"{next(_dump_counter):03d}_graph{graph_index}_{phase}"
            dump_dir.mkdir(parents=True, exist_ok=True)
        results: list[PassResult] = []
        for i, spec in enumerate(self.specs):
            if not spec.runs(self.options):
                results.append(PassResult(name=spec.name, disabled=True))
                continue
            if dump_dir is not None:
                (dump_dir / f"{i:02d}_{spec.name}_before.py").write_text(graph_code(gm))
            start = time.perf_counter()
            with recompile_deferred():  # the compiler regenerates the code once, after all
                result = spec.fn(gm, self.options)
            result.seconds = time.perf_counter() - start
            results.append(result)
            if log.isEnabledFor(logging.INFO):
                log.info("leancompile %s graph %d: %s", phase, graph_index, result.summary())
            if log.isEnabledFor(logging.DEBUG):
                for site in result.skipped:
                    log.debug("leancompile %s: skipped %s", spec.name, site)
            if dump_dir is not None:
                (dump_dir / f"{i:02d}_{spec.name}_after.py").write_text(graph_code(gm))
        if self.options.strict:
            check_all_rewritten(gm, results, phase=phase)
        return GraphRecord(
            graph_index=graph_index, phase=phase, before_snapshot=before,
            after_snapshot=GraphSnapshot(gm), passes=results, op_counts_before=counts_before,
            op_counts_after=op_counts(gm))

    def _run_auto(self, gm: fx.GraphModule, *, phase: str, graph_index: int) -> GraphRecord:
        """``overlap="auto"``: the simulator predicts ``gm``'s time on ``options.device`` after
        each candidate of ``OVERLAP_CANDIDATES`` (each run on a copy), then site by site: each
        site's candidates with every other site left as it is, the best kept for that site
        (sites that look alike, such as one layer's repeats, are predicted once). The
        per-site plan is taken when it is predicted at least 1% faster than the best single
        candidate; else the fastest single candidate (the first within 1% of it: ties go to
        the simpler one). Every rank's graph differs from another's only in rank numbers, so
        every rank predicts the same times and picks the same. The record's ``auto`` says
        what was predicted and which setting each site got."""
        import copy

        from .sim.simulate import simulate

        device = self.options.device or "h200"
        plain = dataclasses.replace(self.options, overlap=None, device=None, strict=False,
                                    overlap_sites=())

        def predict(**extra) -> float:
            trial = copy.deepcopy(gm)
            Pipeline(dataclasses.replace(plain, **extra)).run(
                trial, phase=phase, graph_index=graph_index, recompile=False)  # simulated
            return simulate(trial, device).total_s

        predicted = {name: predict(**extra) for name, extra in OVERLAP_CANDIDATES.items()}
        best = min(predicted.values())
        chosen = next(n for n, t in predicted.items() if t <= best * 1.01)
        sites = overlap_sites(gm)
        plan = {name: chosen for name in sites}
        if len(sites) > 1:
            per_site = self._plan_sites(sites, predicted["none"], predict)
            if len(set(per_site.values())) > 1:
                predicted["per site"] = predict(overlap="flash", overlap_sites=per_site)
                if predicted["per site"] < predicted[chosen] * 0.99:
                    chosen, plan = "per site", per_site
        extra = OVERLAP_CANDIDATES.get(chosen, {"overlap": "flash", "overlap_sites": plan})
        concrete = dataclasses.replace(plain, **extra,
                                       strict=self.options.strict and bool(extra))
        record = Pipeline(concrete).run(gm, phase=phase, graph_index=graph_index,
                                        recompile=False)  # as the outer run() says
        record.auto = {"device": device, "chosen": chosen, "predicted_s": predicted,
                       "sites": plan}
        log.info("leancompile overlap='auto' %s graph %d on %s: %s (%s)", phase, graph_index,
                 device, chosen, ", ".join(f"{n} {t * 1e3:.3f} ms"
                                           for n, t in predicted.items()))
        return record

    @staticmethod
    def _plan_sites(sites: dict, none_s: float, predict) -> dict:
        """Per site, the candidate predicted fastest with every other site left as it is (the
        first within 0.1% of the graph's time of the best: the simpler one)."""
        chosen_for: dict[tuple, str] = {}
        plan = {}
        for name, (kind, signature) in sites.items():
            if signature not in chosen_for:
                left = {other: "none" for other in sites}
                times = {"none": none_s}
                for candidate in SITE_CANDIDATES[kind]:
                    times[candidate] = predict(overlap="flash",
                                               overlap_sites={**left, name: candidate})
                fastest = min(times.values())
                chosen_for[signature] = next(c for c, t in times.items()
                                             if t <= fastest + 1e-3 * none_s)
            plan[name] = chosen_for[signature]
        return plan


SITE_CANDIDATES = {
    "all_gather": ("flash", "flash 2 chunks per rank", "slice 2", "slice 4"),
    "reduce_scatter": ("flash", "flash direct", "flash 2 chunks per rank",
                       "flash projection alone", "slice 2", "slice 4"),
    "all_to_all": ("flash",),
}
"""What ``overlap="auto"`` tries at one site of each kind besides ``"none"`` (the variant and
whether an attention before it is split are a reduce-scatter's choices; all-to-alls have the
query-split schedule only)."""


def overlap_sites(gm: fx.GraphModule) -> dict[str, tuple[str, tuple]]:
    """The collectives the overlap pass can rewrite, in graph order: name -> (kind, a signature
    of what it exchanges and what reads or feeds it, alike for a layer's repeats)."""
    from .passes.flash.vocabulary import ALL_TO_ALL

    kinds = {torch.ops._c10d_functional.all_gather_into_tensor.default: "all_gather",
             torch.ops._c10d_functional.reduce_scatter_tensor.default: "reduce_scatter",
             ALL_TO_ALL: "all_to_all"}

    def shape(node):
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        return (str(node.target), tuple(map(str, getattr(val, "shape", ()))),
                str(getattr(val, "dtype", "")))

    def around(node, depth, back):
        """``node`` and what reads it (``back``: what feeds it), ``depth`` deep."""
        if depth == 0:
            return shape(node)
        near = node.all_input_nodes if back else list(node.users)
        return (shape(node), tuple(sorted(str(around(n, depth - 1, back)) for n in near)))

    return {node.name: (kinds[node.target], (
        kinds[node.target], str(node.args[1:]),
        around(node, 4, back=kinds[node.target] == "reduce_scatter")))
            for node in gm.graph.nodes
            if node.op == "call_function" and node.target in kinds}


class UnrewrittenCollectiveError(RuntimeError):
    """``strict=True``: the overlap pass left collectives in a graph (each listed with why)."""


def check_all_rewritten(gm: fx.GraphModule, results: list[PassResult], *, phase: str) -> None:
    """``CompileOptions(strict=True)``: raise ``UnrewrittenCollectiveError`` when ``gm`` still
    holds a collective after the passes, naming each with the reason its pass gave (or that no
    pass rewrites that kind of collective)."""
    from .passes.bucket_collectives import META_KEY as BUCKET_META
    from .passes.flash.driver import AUTO_KEPT_REASON
    from .passes.prefetch_gathers import META_KEY as PREFETCH_META

    reasons = {site.node: f"{result.name}: {site.reason}" for result in results
               for site in result.skipped}
    chosen = {site.node for result in results for site in result.skipped
              if site.reason == AUTO_KEPT_REASON}  # overlap_sites keeps them on purpose
    left = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        namespace = getattr(node.target, "namespace", None)
        if namespace not in COLLECTIVE_NAMESPACES or "wait_tensor" in str(node.target) or \
                node.name in chosen or PREFETCH_META in node.meta:  # issued ahead: hidden
            continue
        bucket = node.meta.get(BUCKET_META)
        why = (f"bucket_collectives merged collectives the overlap pass left into it ({bucket}; "
               "each member's reason is in the overlap pass's report)" if bucket else
               reasons.get(node.name) or
               f"no leancompile pass rewrites {getattr(node.target, '__name__', node.target)}")
        left.append(f"{node.name} ({node.target}): {why}")
    if left:
        raise UnrewrittenCollectiveError(
            f"strict=True: the {phase} graph keeps {len(left)} collective(s) the overlap pass "
            "did not rewrite, so their communication stays exposed:\n  " + "\n  ".join(left) +
            "\nFix the reason given for each, or drop strict=True to compile them as they are")
