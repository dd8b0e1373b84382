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

import torch.fx as fx

from .report import GraphRecord, GraphSnapshot, graph_code, op_counts
from .options import CompileOptions
from .passes import PASSES, PassSpec
from .passes.result import PassResult

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

    def run(self, gm: fx.GraphModule, *, phase: str, graph_index: int = 0) -> GraphRecord:
        if self.options.overlap == "auto":
            return self._run_auto(gm, phase=phase, graph_index=graph_index)
        before = GraphSnapshot(gm)  # code printed only if the report is read
        counts_before = op_counts(gm)
        debug_dir = os.environ.get(DEBUG_ENV)
        dump_dir = None
        if debug_dir:
            dump_dir = Path(debug_dir) / f"{next(_dump_counter):03d}_graph{graph_index}_{phase}"
            dump_dir.mkdir(parents=True, exist_ok=True)
        results: list[PassResult] = []
        for i, spec in enumerate(self.specs):
            if spec.name in self.options.disable or not spec.active(self.options):
                results.append(PassResult(name=spec.name, disabled=True))
                continue
            if dump_dir is not None:
                (dump_dir / f"{i:02d}_{spec.name}_before.py").write_text(graph_code(gm))
            start = time.perf_counter()
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
        """``overlap="auto"``: every candidate of ``AUTO_CANDIDATES`` runs on a copy of
        ``gm``, the simulator predicts each copy's time on ``options.device``, and the
        fastest (the first within 1% of it: ties go to the simpler one, and every rank, whose
        graphs differ only in rank numbers, picks the same) runs on ``gm``. The record's
        ``auto`` says what was predicted."""
        import copy

        from .sim.simulate import simulate

        device = self.options.device or "h200"
        plain = dataclasses.replace(self.options, overlap=None, device=None, strict=False)
        predicted = {}
        for name, extra in AUTO_CANDIDATES.items():
            candidate = dataclasses.replace(plain, **extra)
            trial = copy.deepcopy(gm)
            Pipeline(candidate).run(trial, phase=phase, graph_index=graph_index)
            predicted[name] = simulate(trial, device).total_s
        best = min(predicted.values())
        chosen = next(n for n, t in predicted.items() if t <= best * 1.01)
        extra = AUTO_CANDIDATES[chosen]
        concrete = dataclasses.replace(plain, **extra,
                                       strict=self.options.strict and bool(extra))
        record = Pipeline(concrete).run(gm, phase=phase, graph_index=graph_index)
        record.auto = {"device": device, "chosen": chosen, "predicted_s": predicted}
        log.info("leancompile overlap='auto' %s graph %d on %s: %s (%s)", phase, graph_index,
                 device, chosen, ", ".join(f"{n} {t * 1e3:.3f} ms"
                                           for n, t in predicted.items()))
        return record


AUTO_CANDIDATES = {
    "none": {},
    "flash": {"overlap": "flash"},
    "flash direct": {"overlap": "flash", "variant": "direct"},
    "flash 2 chunks per rank": {"overlap": "flash", "chunks_per_rank": 2},
    "slice 2": {"overlap": "slice", "chunks": 2},
    "slice 4": {"overlap": "slice", "chunks": 4},
}
"""What ``overlap="auto"`` chooses from, simplest first."""


class UnrewrittenCollectiveError(RuntimeError):
    """``strict=True``: the overlap pass left collectives in a graph (each listed with why)."""


_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional")


def check_all_rewritten(gm: fx.GraphModule, results: list[PassResult], *, phase: str) -> None:
    """``CompileOptions(strict=True)``: raise ``UnrewrittenCollectiveError`` when ``gm`` still
    holds a collective after the passes, naming each with the reason its pass gave (or that no
    pass rewrites that kind of collective)."""
    reasons = {site.node: f"{result.name}: {site.reason}" for result in results
               for site in result.skipped}
    left = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        namespace = getattr(node.target, "namespace", None)
        if namespace not in _COLLECTIVE_NAMESPACES or "wait_tensor" in str(node.target):
            continue
        why = reasons.get(node.name) or (
            f"no leancompile pass rewrites {getattr(node.target, '__name__', node.target)}")
        left.append(f"{node.name} ({node.target}): {why}")
    if left:
        raise UnrewrittenCollectiveError(
            f"strict=True: the {phase} graph keeps {len(left)} collective(s) the overlap pass "
            "did not rewrite, so their communication stays exposed:\n  " + "\n  ".join(left) +
            "\nFix the reason given for each, or drop strict=True to compile them as they are")
