"""What a compile did to its graphs: ``GraphRecord`` per graph, ``Report`` per compile, and the
helpers that print graph code and count ops."""

from __future__ import annotations

import difflib
import html
import json
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch.fx as fx

from .passes.result import PassResult
from .passes.structure import Structure

__all__ = ["GraphRecord", "GraphSnapshot", "Report", "last_report", "record_report", "graph_code",
           "op_counts", "op_count_diff"]


def graph_code(gm: fx.GraphModule) -> str:
    """The graph as Python, with tensor shapes and dtypes as annotations."""
    try:
        return gm.print_readable(print_output=False, include_stride=False, include_device=False)
    except TypeError:  # older torch without the include_* flags
        return gm.print_readable(print_output=False)


class GraphSnapshot:
    """A graph as it was at one moment of the pipeline: its structure kept at compile time
    (``passes.structure.Structure``: a tuple per node, metadata shared), rebuilt as a graph and
    printed as code only when someone reads it (``str(snapshot)``, ``snapshot.graph``; the
    first read caches it). Copying and printing graphs was most of what a report cost, and
    most compiles never show their report."""

    __slots__ = ("_structure", "_graph", "_code")

    def __init__(self, gm: fx.GraphModule):
        self._structure = Structure(gm.graph)
        self._graph: fx.Graph | None = None  # rebuilt from the structure on the first read
        self._code: str | None = None

    def __str__(self) -> str:
        if self._code is None:
            self._code = _graph_code(self.graph)
        return self._code

    @property
    def graph(self) -> fx.Graph:
        """The graph itself: what ``leancompile.sim.simulate`` simulates."""
        if self._graph is None:
            self._graph = self._structure.graph()
        return self._graph


def _graph_code(graph: fx.Graph) -> str:
    """``GraphModule.print_readable``'s text for a bare graph."""
    try:
        src = graph.python_code(root_module="self", verbose=True, include_stride=False,
                                include_device=False).src
    except TypeError:  # older torch without the include_* flags
        src = graph.python_code(root_module="self", verbose=True).src
    body = "\n".join("    " + line if line.strip() else line for line in src.strip("\n").split("\n"))
    return f"class GraphModule(torch.nn.Module):\n{body}\n"


def op_name(node: fx.Node) -> str:
    target = node.target
    if hasattr(target, "_schema"):
        return str(target)
    return getattr(target, "__name__", str(target))


def op_counts(gm: fx.GraphModule) -> Counter:
    """How many times each ``call_function`` target occurs (``"aten.mm.default": 4``)."""
    return Counter(op_name(n) for n in gm.graph.nodes if n.op == "call_function")


def op_count_diff(before: Counter, after: Counter) -> dict[str, tuple[int, int]]:
    """The ops whose count changed, as ``{op: (before, after)}``, sorted by name."""
    return {op: (before.get(op, 0), after.get(op, 0))
            for op in sorted(set(before) | set(after)) if before.get(op, 0) != after.get(op, 0)}


@dataclass(kw_only=True)
class GraphRecord:
    """One graph (forward, backward or inference) before and after the pipeline."""

    graph_index: int
    """Which Dynamo graph of the compile this came from (0 unless there were graph breaks)."""
    phase: str
    """``"forward"``, ``"backward"`` or ``"inference"``."""
    before_snapshot: GraphSnapshot
    after_snapshot: GraphSnapshot
    passes: list[PassResult]
    op_counts_before: Counter
    op_counts_after: Counter
    auto: dict | None = None
    """``overlap="auto"``: the device, the candidate chosen and each candidate's predicted
    seconds."""
    cached: bool = False
    """Inductor's FX graph cache served this graph's code (``lean_compile``): the pipeline ran
    again on the graph for what it records (the report, the LeanGRPO stage's row layouts), not
    for the code."""
    seconds: float = 0.0
    """Wall time of the whole pipeline on this graph: the passes, the snapshots and op counts
    of the report and, under ``overlap="auto"``, the candidates' trials (what
    ``leancompile bench compile`` counts as the pipeline's own time)."""

    @property
    def before(self) -> str:
        """The graph's code before our passes (printed on first read)."""
        return str(self.before_snapshot)

    @property
    def after(self) -> str:
        """The graph's code after our passes (printed on first read)."""
        return str(self.after_snapshot)

    @property
    def name(self) -> str:
        return f"graph{self.graph_index}_{self.phase}"

    @property
    def op_diff(self) -> dict[str, tuple[int, int]]:
        return op_count_diff(self.op_counts_before, self.op_counts_after)

    def summary(self) -> str:
        lines = [f"{self.name}: {sum(self.op_counts_before.values())} -> "
                 f"{sum(self.op_counts_after.values())} ops"
                 + (" (code served from Inductor's cache)" if self.cached else "")]
        if self.auto:
            predicted = ", ".join(f"{name} {t * 1e3:.3f} ms"
                                  for name, t in self.auto["predicted_s"].items())
            lines.append(f"  overlap='auto' on {self.auto['device']}: {self.auto['chosen']} "
                         f"(predicted: {predicted})")
            if self.auto["chosen"] == "per site":
                lines += [f"    {site}: {setting}"
                          for site, setting in self.auto["sites"].items()]
        for result in self.passes:
            lines.append(f"  {result.summary()}")
            kinds = Counter(site.kind for site in result.rewritten)
            for kind, count in sorted(kinds.items()):
                nodes = [site.node for site in result.rewritten if site.kind == kind]
                shown = ", ".join(nodes[:6]) + (", ..." if len(nodes) > 6 else "")
                lines.append(f"    rewrote {count} x {kind}: {shown}")
            for site in result.skipped:
                lines.append(f"    skipped {site}")
            for note in result.notes:
                lines.append(f"    note: {note}")
        if self.op_diff:
            lines.append("  op counts changed:")
            for op, (b, a) in self.op_diff.items():
                lines.append(f"    {op}: {b} -> {a}")
        return "\n".join(lines)


@dataclass(kw_only=True)
class Report:
    """The graphs one compile produced and what every pass did to each of them.

    ``print(report)`` gives a summary; ``report.save(dir)`` writes the code of every graph
    before and after and one self-contained HTML page with side-by-side diffs.
    """

    options: dict
    graphs: list[GraphRecord] = field(default_factory=list)
    cached: bool = False
    """True when Inductor served the compiled forward from its cache (FX graph cache or
    AOTAutograd cache): the passes did not run in this process, so there is nothing to show.
    The cache key holds our pass uuid, so the cached graphs came from the same passes, options
    and rank."""

    def graph(self, phase: str, index: int = 0) -> GraphRecord:
        for record in self.graphs:
            if record.phase == phase and record.graph_index == index:
                return record
        have = [r.name for r in self.graphs]
        raise KeyError(f"no {phase} graph with index {index} in this report; it has {have}")

    @property
    def phases(self) -> list[str]:
        return [r.phase for r in self.graphs]

    def pass_results(self, name: str) -> list[PassResult]:
        return [p for r in self.graphs for p in r.passes if p.name == name]

    def __str__(self) -> str:
        head = (f"leancompile report: {len(self.graphs)} graph(s) "
                f"[{', '.join(r.name for r in self.graphs)}], options {self.options}")
        if self.cached and not self.graphs:
            return head + ("\n  served from Inductor's compile cache: the passes ran when the "
                           "cache entry was made (same passes, options and rank), not now; use "
                           "leancompile.explain() to see the graphs")
        if not self.graphs:
            return head + "\n  (no graphs captured yet)"
        return "\n".join([head] + [r.summary() for r in self.graphs])

    def to_dict(self) -> dict:
        return {
            "options": self.options,
            "cached": self.cached,
            "graphs": [{"name": r.name, "phase": r.phase, "graph_index": r.graph_index,
                        "passes": [p.to_dict() for p in r.passes],
                        "op_diff": {k: list(v) for k, v in r.op_diff.items()},
                        "auto": r.auto, "seconds": r.seconds, "cached": r.cached}
                       for r in self.graphs],
        }

    def save(self, directory) -> Path:
        """Write ``<name>_before.py``, ``<name>_after.py``, ``report.json``, ``report.txt``
        and ``report.html`` into ``directory`` (created if missing); returns the HTML path."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        for record in self.graphs:
            (out / f"{record.name}_before.py").write_text(record.before)
            (out / f"{record.name}_after.py").write_text(record.after)
        (out / "report.txt").write_text(str(self) + "\n")
        (out / "report.json").write_text(json.dumps(self.to_dict(), indent=2, default=str))
        page = out / "report.html"
        page.write_text(self.html())
        return page

    def html(self) -> str:
        differ = difflib.HtmlDiff(wrapcolumn=100)
        parts = []
        for record in self.graphs:
            rows = "".join(
                f"<tr><td>{html.escape(op)}</td><td>{b}</td><td>{a}</td></tr>"
                for op, (b, a) in record.op_diff.items()) or "<tr><td colspan=3>no change</td></tr>"
            parts.append(
                f"<h2>{html.escape(record.name)}</h2>"
                f"<pre>{html.escape(record.summary())}</pre>"
                f"<table class='ops'><tr><th>op</th><th>before</th><th>after</th></tr>{rows}"
                "</table>"
                + differ.make_table(record.before.splitlines(), record.after.splitlines(),
                                    fromdesc="before", todesc="after"))
        style = ("body{font-family:sans-serif} pre{background:#f6f6f6;padding:6px} "
                 "table.diff{font-family:monospace;font-size:12px;border:1px solid #ccc} "
                 ".diff_add{background:#aaffaa} .diff_chg{background:#ffff77} "
                 ".diff_sub{background:#ffaaaa} table.ops td,table.ops th{padding:2px 8px}")
        return (
            "<!DOCTYPE html><html><head><meta charset='utf-8'><title>leancompile report</title>"
            f"<style>{style}</style></head><body><h1>leancompile report</h1>"
            f"<p>options: {html.escape(str(self.options))}</p>"
            + "".join(parts) + "</body></html>")


_lock = threading.Lock()
_last: list[Report] = []


def record_report(report: Report) -> None:
    """Make ``report`` the one ``last_report()`` returns."""
    with _lock:
        _last[:] = [report]


def last_report() -> Report | None:
    """The report of the latest compile through leancompile in this process (or ``None``)."""
    with _lock:
        return _last[0] if _last else None
