"""leancompile: compiler passes on torch.compile graphs.

Entry points: ``backend(**options)`` (a torch.compile backend, also registered as
``"leancompile"``), ``lean_compile`` (decorator), ``install(**options)`` (hook into a trainer
that already compiles), and ``explain(fn, *args)`` / ``last_report()`` to see what the passes
did. Importing this package changes no torch config and no environment variable.
"""

from .compiler import (Installation, LeanGraphPass, __version__, backend, install,
                       lean_compile)
from .explain import explain
from .graphs.report import GraphRecord, Report, last_report
from .options import CompileOptions
from .passes import PassResult, Site, pass_names

__all__ = [
    "backend", "lean_compile", "install", "Installation", "explain", "last_report", "Report",
    "GraphRecord", "CompileOptions", "PassResult", "Site", "pass_names", "LeanGraphPass",
    "__version__",
]
