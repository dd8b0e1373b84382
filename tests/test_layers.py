"""The import rules of the package, checked on its source (every import, in-function ones
included, read from the AST):

- imports run one way: a module imports only from its own layer or a lower one (``LAYERS``,
  lowest first; docs/architecture.md's "The layers" lists the same, the README in short);
- no import cycle between modules (a cycle hidden inside a function is still one);
- no underscore name imported from another module (shared helpers get public names).

``test_the_checker_finds_each_kind`` plants one of each in a small package to show the checks
can fail."""

from __future__ import annotations

import ast
import itertools
import pathlib
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent / "leancompile"

LAYERS = (
    ("runtime",),
    ("passes",),
    ("options",),
    ("report",),
    ("sim", "sim.devices", "sim.simulate", "sim.calibrate"),  # the device model
    ("pipeline",),
    ("capture",),
    ("compiler",),
    ("step", "lean"),  # (step.py: the old import path of lean/)
    ("explain",),
    ("sim.fullscale", "sim.plan", "sim.schemes"),  # full-size graphs through the pipeline
    ("",),  # the package itself: leancompile/__init__.py, the public API
    ("grpo",),
    ("integrations",),
    ("demos",),
    ("benchmarks",),
    ("check_inputs",),
    ("cli", "__main__"),
)
"""Lowest first; a name is a module or package below ``leancompile`` (the most specific name
that covers a module decides its layer)."""


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _layer(module: str, package: str, layers) -> int | None:
    rest = module[len(package) + 1:] if module != package else ""
    best, best_len = None, -1
    for i, names in enumerate(layers):
        for name in names:
            covers = rest == name or (name and rest.startswith(name + "."))
            if covers and len(name) > best_len:
                best, best_len = i, len(name)
            elif name == "" and best is None and rest == "":
                best, best_len = i, 0
    return best


def imports(root: pathlib.Path) -> tuple[dict, list]:
    """(module -> the package's modules it imports, [(module, from_module, private name)])."""
    package = root.name
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for module, path in modules.items():
        here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[:len(here) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != package:
                    continue
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    if full in modules:  # a submodule
                        edges[module].add(full)
                        continue
                    edges[module].add(target)
                    if alias.name.startswith("_") and not alias.name.startswith("__") and \
                            target != module:
                        private.append((module, target, alias.name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == package:
                        edges[module].add(alias.name)
    edges = {m: {t for t in ts if t in modules and t != m} for m, ts in edges.items()}
    return edges, private


def upward(edges: dict, package: str, layers) -> list[tuple[str, str]]:
    found = []
    for module, targets in edges.items():
        mine = _layer(module, package, layers)
        for target in targets:
            theirs = _layer(target, package, layers)
            if mine is None or theirs is None or theirs > mine:
                found.append((module, target))
    return sorted(found)


def cycles(edges: dict) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    counter, index, low, stack, on, found = itertools.count(), {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = next(counter)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    edges, _ = imports(ROOT)
    assert [m for m in edges if _layer(m, ROOT.name, LAYERS) is None] == []


def test_imports_run_one_way():
    edges, _ = imports(ROOT)
    assert upward(edges, ROOT.name, LAYERS) == []


def test_no_import_cycle():
    edges, _ = imports(ROOT)
    assert cycles(edges) == []


def test_no_private_name_imported_from_another_module():
    _, private = imports(ROOT)
    assert private == []


def test_the_checker_finds_each_kind(tmp_path):
    """A package ``pkg`` with layers low < high: ``low`` imports from ``high`` inside a
    function (upward), ``high.a`` imports ``high.b`` which takes ``_helper`` from ``low`` (a
    private name, and with the upward import a cycle through all three)."""
    pkg = tmp_path / "pkg"
    (pkg / "high").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "low.py": "def _helper():\n    from .high.a import f\n    return f\n",
        "high/__init__.py": "",
        "high/a.py": "def f():\n    from .b import g\n    return g\n",
        "high/b.py": "from ..low import _helper\n\ndef g():\n    from . import a\n    return a\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(textwrap.dedent(text))
    layers = (("low",), ("high",), ("",))
    edges, private = imports(pkg)
    assert upward(edges, "pkg", layers) == [("pkg.low", "pkg.high.a")]
    assert cycles(edges) == [["pkg.high.a", "pkg.high.b", "pkg.low"]]
    assert private == [("pkg.high.b", "pkg.low", "_helper")]
