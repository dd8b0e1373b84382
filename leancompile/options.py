"""The options every entry point takes, validated once, in one keyword-only dataclass."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

__all__ = ["CompileOptions", "COMPILERS", "OVERLAP_CANDIDATES", "check_bucket_cap_mb"]

COMPILERS = ("inductor", "aot_eager")
# Values later passes will accept; until they land, anything but None is refused with a reason.
_OVERLAP_VALUES: tuple = (None, "flash", "slice", "auto")
_VARIANTS = ("ring", "direct")
_MODE_OF_OPTION = {"variant": "flash", "chunks_per_rank": "flash", "chunks": "slice"}
"""The overlap mode each mode-specific option belongs to."""
_SCHEDULE_VALUES: tuple = (None, "auto", "retain", "reweight", "recompute")
OVERLAP_CANDIDATES = {
    "none": {},
    "flash": {"overlap": "flash"},
    "flash direct": {"overlap": "flash", "variant": "direct"},
    "flash 2 chunks per rank": {"overlap": "flash", "chunks_per_rank": 2},
    "flash projection alone": {"overlap": "flash", "attention_split": False},
    "slice 2": {"overlap": "slice", "chunks": 2},
    "slice 4": {"overlap": "slice", "chunks": 4},
}
"""The overlap settings ``overlap="auto"`` chooses from (for a whole graph or per site), simplest
first, and the values ``overlap_sites`` takes."""
_ON_ERROR_VALUES = ("skip", "raise")


def check_bucket_cap_mb(value) -> None:
    """``bucket_cap_mb`` is None (no bucketing) or a number of MiB > 0, else ValueError."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or value <= 0):
        raise ValueError(f"bucket_cap_mb={value!r} must be a number of MiB > 0 (or None: one "
                         "collective each, no bucketing)")


@dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """Options of the leancompile pipeline.

    Build it with ``CompileOptions.from_kwargs(**options)`` to get an error that names an
    unknown option and lists the known ones.
    """

    compiler: str = "inductor"
    """What compiles the graphs after our passes: ``"inductor"`` or ``"aot_eager"`` (runs the
    rewritten aten graphs eagerly; for tests and debugging)."""

    disable: tuple[str, ...] = field(default_factory=tuple)
    """Names of passes to skip (see ``leancompile.passes.pass_names()``)."""

    overlap: str | None = None
    """Communication/compute overlap: ``"flash"`` (FlashOverlap: decomposed P2P schedules),
    ``"slice"`` (the data-slicing baseline, ``chunks`` async collectives), ``"auto"`` (what the
    simulator predicts fastest on ``device``, for each graph: one of ``OVERLAP_CANDIDATES``
    (none, flash ring or direct, flash with 2 chunks per rank, flash with the attention before
    a reduce-scatter left whole, slice in 2 or 4) for the whole
    graph, or one per site (``overlap_sites``) when that is predicted faster) or None (off)."""

    device: str | None = None
    """``overlap="auto"``: the device profile it predicts on (``leancompile/sim/devices``; a
    built-in name or a JSON file; default ``"h200"``)."""

    variant: str | None = None
    """Flash reduce-scatter: ``"ring"`` (the default: partials accumulate along the ring) or
    ``"direct"`` (each partial sent to its owner, local reduce). ``overlap="flash"`` only."""

    chunks_per_rank: int | None = None
    """Flash: slices per rank (the sequence is cut into ``world_size * chunks_per_rank``;
    default 1). ``overlap="flash"`` only."""

    chunks: int | None = None
    """Slice: chunks of the data-slicing baseline (default 2). ``overlap="slice"`` only."""

    on_error: str = "skip"
    """What a pass does when rewriting a site raises: ``"skip"`` leaves that site as it was,
    reports it skipped with the exception and warns (the compile goes on); ``"raise"``
    propagates the exception (for debugging; the test suite sets ``LEANCOMPILE_ON_ERROR=raise``,
    which has the same effect)."""

    attention_split: bool = True
    """With ``overlap=``: a reduce-scatter whose matmul reads an attention's output with the
    query rows along the scattered dim (a row-parallel output projection under tensor +
    sequence parallelism) computes the attention one slice of queries at a time inside its
    schedule, so the first partials are sent while the rest of the attention runs. ``False``:
    the attention runs whole first (the schedule covers the projection alone)."""

    overlap_sites: tuple = ()
    """Per collective, an overlap setting other than the graph's: ``{node name: candidate}``
    (a dict, kept as sorted pairs), the node names as ``explain`` shows them, the candidates
    those of ``OVERLAP_CANDIDATES`` (``"none"`` leaves the site as it is). Sites not named
    follow ``overlap=`` (``"flash"`` or ``"slice"``). ``overlap="auto"`` sets it when it
    predicts that settings chosen site by site beat one setting for the whole graph."""

    strict: bool = False
    """With ``overlap=``: a collective the overlap pass left in the graph (skipped, or of a kind
    it does not rewrite) raises ``UnrewrittenCollectiveError`` listing every such site and its
    reason, instead of compiling the graph with that communication exposed."""

    bucket_cap_mb: float | None = None
    """Bucket the all-gathers and reduce-scatters the overlap pass leaves: consecutive ones of
    one process group and dtype merged into one collective over a flat buffer of at most this
    many MiB (``passes/bucket_collectives.py``), as ``DistributedDataParallel(bucket_cap_mb=)``
    buckets its all-reduces; a sharded step's per-parameter gathers and gradient reductions
    become a few large ones. None: off. Reductions over more than two ranks may then round
    differently (the backend sums a larger buffer), so it is opt-in."""

    gather_at_use: bool = False
    """Move each parameter's all-gather (a gather of a graph input) to where the graph first
    reads the gathered weight (``passes/gather_at_use.py``), so that a sharded step holds a few
    gathered weights at a time rather than the whole model; with ``bucket_cap_mb`` the buckets
    then follow the order of use, each issued one bucket ahead. Values are unchanged."""

    schedule: str | None = None
    """LeanGRPO schedule of a step wrapped by ``lean_compile(fn, schedule=...)``: ``auto``,
    ``retain``, ``reweight`` or ``recompute`` (see ``leancompile/lean``); turns on the
    ``lean_grpo`` stage of the pipeline. ``backend()`` and ``install()`` refuse it: the
    rollout/update phases live on the object ``lean_compile`` returns."""

    def __post_init__(self):
        from .passes import pass_names

        if self.compiler not in COMPILERS:
            raise ValueError(
                f"compiler={self.compiler!r} is not supported; use one of {COMPILERS}")
        if isinstance(self.disable, str):
            object.__setattr__(self, "disable", (self.disable,))
        object.__setattr__(self, "disable", tuple(self.disable))
        known = pass_names()
        unknown = [name for name in self.disable if name not in known]
        if unknown:
            raise ValueError(
                f"disable={self.disable!r} names unknown pass(es) {unknown}; "
                f"the passes are {list(known)}")
        if self.overlap not in _OVERLAP_VALUES:
            raise ValueError(
                f"overlap={self.overlap!r} is not supported; use one of {_OVERLAP_VALUES}")
        if self.variant is not None and self.variant not in _VARIANTS:
            raise ValueError(f"variant={self.variant!r} is not supported; use one of "
                             f"{_VARIANTS}")
        for name in ("chunks_per_rank", "chunks"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        for name, mode in _MODE_OF_OPTION.items():
            if getattr(self, name) is not None and self.overlap != mode:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} applies to overlap={mode!r} only; with "
                    f"overlap={self.overlap!r} it would be ignored: drop it, or pass "
                    f"overlap={mode!r}")
        if isinstance(self.overlap_sites, dict):
            object.__setattr__(self, "overlap_sites", tuple(sorted(self.overlap_sites.items())))
        sites = dict(self.overlap_sites)
        unknown = {k: v for k, v in sites.items() if v not in OVERLAP_CANDIDATES}
        if unknown:
            raise ValueError(f"overlap_sites={unknown!r}: each site takes one of "
                             f"{list(OVERLAP_CANDIDATES)}")
        if sites and self.overlap not in ("flash", "slice"):
            raise ValueError(f"overlap_sites sets some sites apart from overlap=; with "
                             f"overlap={self.overlap!r} pass overlap='flash' or 'slice' for the "
                             "sites it does not name")
        if self.device is not None and self.overlap != "auto":
            raise ValueError(f"device={self.device!r} is what overlap='auto' predicts on; with "
                             f"overlap={self.overlap!r} it would be ignored")
        if self.on_error not in _ON_ERROR_VALUES:
            raise ValueError(f"on_error={self.on_error!r} is not supported; use one of "
                             f"{_ON_ERROR_VALUES}")
        check_bucket_cap_mb(self.bucket_cap_mb)
        if not isinstance(self.gather_at_use, bool):
            raise ValueError(f"gather_at_use={self.gather_at_use!r} must be True or False")
        if not isinstance(self.attention_split, bool):
            raise ValueError(f"attention_split={self.attention_split!r} must be True or False")
        if not isinstance(self.strict, bool):
            raise ValueError(f"strict={self.strict!r} must be True or False")
        if self.strict and self.overlap is None:
            raise ValueError("strict=True checks that the overlap pass rewrote every "
                             "collective; without overlap= nothing is rewritten: pass "
                             "overlap='flash' (or 'slice'), or drop strict")
        if self.schedule not in _SCHEDULE_VALUES:
            raise ValueError(
                f"schedule={self.schedule!r} is not supported; use one of {_SCHEDULE_VALUES}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "CompileOptions":
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise TypeError(
                f"unknown leancompile option(s) {unknown}; the options are {names}")
        return cls(**kwargs)

    @property
    def flash_variant(self) -> str:
        """The Flash reduce-scatter variant in effect (``variant`` or its default)."""
        return self.variant or "ring"

    @property
    def flash_chunks_per_rank(self) -> int:
        """Flash slices per rank in effect (``chunks_per_rank`` or its default)."""
        return self.chunks_per_rank or 1

    @property
    def slice_chunks(self) -> int:
        """Chunks of the slicing baseline in effect (``chunks`` or its default)."""
        return self.chunks or 2

    def for_site(self, name: str) -> "CompileOptions":
        """The options the collective ``name`` is rewritten with: its ``overlap_sites`` entry
        when it has one (``overlap=None`` for ``"none"``), else these."""
        candidate = dict(self.overlap_sites).get(name)
        if candidate is None:
            return self
        extra = OVERLAP_CANDIDATES[candidate]
        return dataclasses.replace(
            self, overlap=extra.get("overlap"), variant=extra.get("variant"),
            chunks_per_rank=extra.get("chunks_per_rank"), chunks=extra.get("chunks"),
            attention_split=extra.get("attention_split", True), overlap_sites=(), strict=False)

    def cache_key(self) -> dict:
        """Everything that changes what the passes produce, as plain JSON-able data."""
        return {"compiler": self.compiler, "disable": sorted(self.disable),
                "overlap": self.overlap, "variant": self.variant,
                "chunks_per_rank": self.chunks_per_rank, "chunks": self.chunks,
                "on_error": self.on_error, "schedule": self.schedule, "strict": self.strict,
                "device": self.device, "overlap_sites": dict(self.overlap_sites),
                "attention_split": self.attention_split, "bucket_cap_mb": self.bucket_cap_mb,
                "gather_at_use": self.gather_at_use}
