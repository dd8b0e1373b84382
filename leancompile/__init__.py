"""leancompile: compiler passes on torch.compile graphs.

Entry points: ``backend(**options)`` (a torch.compile backend, also registered as
``"leancompile"``), ``lean_compile`` (decorator), ``install(**options)`` (hook into a trainer
that already compiles), and ``explain(fn, *args)`` / ``last_report()`` to see what the passes
did; ``simulate(graphs, device=...)`` predicts their time and memory on hardware this machine
does not have (``leancompile/sim``). Importing this package changes no torch config and no environment variable; it registers
the ``leancompile::`` ops of ``runtime/p2p.py``, so a graph Inductor serves from its cache (with
no pass run in this process) finds the P2P ops it calls.
"""

from .compiler import Installation, LeanGraphPass, __version__, backend, install
from .explain import explain
from .report import GraphRecord, Report, last_report
from .options import CompileOptions
from .passes import PassResult, Site, pass_names
from .pipeline import UnrewrittenCollectiveError
from .runtime import p2p as _p2p  # noqa: F401  (registers the leancompile:: ops)
from .sim import DeviceProfile, Timeline, simulate
from .lean import lean_compile

__all__ = [
    "backend", "lean_compile", "install", "Installation", "explain", "last_report", "Report",
    "GraphRecord", "CompileOptions", "PassResult", "Site", "pass_names", "LeanGraphPass",
    "UnrewrittenCollectiveError", "simulate", "Timeline", "DeviceProfile", "__version__",
]
