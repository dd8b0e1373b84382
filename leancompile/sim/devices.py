"""Device profiles for the simulator: what one accelerator and its links can do, as data.

A profile is a ``DeviceProfile`` (keyword-only dataclass); the built-in ones are JSON files
next to this module (``devices/<name>.json``), each number with its source in the file's
``sources``. Users add their own with ``DeviceProfile.from_json(path)`` or by building one::

    from leancompile.sim import DeviceProfile, device_profile
    h200 = device_profile("h200")
    mine = dataclasses.replace(h200, name="h200-pcie", link_bandwidth=25e9,
                               symmetric_memory=False)

What the numbers mean (the simulator's model, ``leancompile/sim/simulate.py``):

- ``flops[dtype]``: dense peak FLOP/s of that dtype (matrix units where the dtype uses them).
  A matmul of F FLOPs takes ``matmul_overhead + F / (peak * matmul_efficiency)`` (large
  matmuls approach ``matmul_efficiency`` of the peak; small ones are launch and tile bound).
- ``memory_bandwidth``: bytes/s of device memory; every kernel moves its inputs and output at
  least once (roofline: a kernel takes the larger of its compute and its memory time, plus
  ``kernel_overhead``).
- ``link_bandwidth`` / ``link_latency``: one point-to-point message to one peer takes
  ``link_latency + bytes / link_bandwidth`` (per direction: a send and a receive at once are
  one hop). ``collective_bandwidth``: the bus bandwidth a ring collective reaches (defaults to
  ``link_bandwidth``); an all-gather of N shards of B bytes takes
  ``(N - 1) * (collective_latency + B / collective_bandwidth)``; reduce-scatters and
  all-reduces use ``reduce_bandwidth`` (defaults to ``collective_bandwidth``);
  ``collective_latency`` (the alpha of one ring step) defaults to ``link_latency``.
- ``symmetric_memory``: whether peers can read each other's memory directly (NVLink/NVSwitch
  within one host), which PyTorch's async-TP needs.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DeviceProfile", "device_profile", "device_names"]

_HERE = Path(__file__).parent / "devices"

_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                "float": "float32", "fp64": "float64", "double": "float64"}


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """One accelerator and its links (module docstring)."""

    name: str
    flops: dict[str, float]
    """Dense peak FLOP/s per dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``, ...)."""
    memory_bandwidth: float
    """Device memory bytes/s."""
    link_bandwidth: float
    """Point-to-point bytes/s to one peer, per direction."""
    link_latency: float
    """Seconds per message (the alpha of the alpha-beta model)."""
    memory_bytes: int
    """Device memory capacity."""
    collective_bandwidth: float | None = None
    """Bus bytes/s of ring collectives (None: ``link_bandwidth``)."""
    collective_latency: float | None = None
    """Seconds per ring step of a collective (None: ``link_latency``). Set where a collective's
    steps cost another fixed time than one message: gloo's own ring against leancompile's P2P
    exchange, which also writes and checks a header in Python."""
    reduce_bandwidth: float | None = None
    """Bus bytes/s of the collectives that also add (reduce-scatter, all-reduce; None:
    ``collective_bandwidth``). NCCL reaches about the same as for gathers; gloo on a CPU sums
    on the cores, more slowly."""
    kernel_overhead: float = 4e-6
    """Seconds each compute kernel costs beyond its roofline time (launch, tail)."""
    matmul_efficiency: float = 0.75
    """Fraction of the peak a large matmul reaches."""
    matmul_overhead: float = 5e-6
    """Seconds a matmul costs beyond ``F / (peak * matmul_efficiency)`` (tiles, launch): what
    makes small matmuls slow."""
    comm_compute_overlap: float = 1.0
    """Fraction of a transfer's time compute can run beside it: 1 where copy engines or the
    network move the data (GPUs); less on a CPU, where gloo's threads copy on the cores the
    compute uses (the rest of each transfer holds the compute stream too). Negative where
    running the two side by side costs more than running them one after the other (ranks and
    gloo's threads oversubscribing a few cores: switches, caches): a transfer with compute
    issued beside it (before its wait) then also costs the compute stream ``-overlap x
    min(transfer, that compute)``; as in the calibration, which times them apart and
    together."""
    symmetric_memory: bool = False
    """Peers can read each other's memory (NVLink within one host): async-TP can run."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each number comes from."""
    notes: str = ""

    def __post_init__(self):
        for name in ("memory_bandwidth", "link_bandwidth", "memory_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{self.name}: {name}={getattr(self, name)!r} must be > 0")
        if not self.flops or any(not v > 0 for v in self.flops.values()):
            raise ValueError(f"{self.name}: flops={self.flops!r} needs a positive FLOP/s for "
                             "at least one dtype")
        if not 0 < self.matmul_efficiency <= 1:
            raise ValueError(f"{self.name}: matmul_efficiency={self.matmul_efficiency} must "
                             "be in (0, 1]")
        if not -1 <= self.comm_compute_overlap <= 1:
            raise ValueError(f"{self.name}: comm_compute_overlap={self.comm_compute_overlap} "
                             "must be in [-1, 1]")
        if self.link_latency < 0 or self.kernel_overhead < 0 or \
                (self.collective_latency or 0) < 0:
            raise ValueError(f"{self.name}: latencies must be >= 0")

    @property
    def ring_step_latency(self) -> float:
        return self.link_latency if self.collective_latency is None else self.collective_latency

    @property
    def bus_bandwidth(self) -> float:
        return self.collective_bandwidth or self.link_bandwidth

    @property
    def reduction_bandwidth(self) -> float:
        return self.reduce_bandwidth or self.bus_bandwidth

    def peak_flops(self, dtype) -> float:
        """Peak FLOP/s for a torch dtype (or its name); a dtype the profile does not list
        runs at the float32 rate (or the slowest listed)."""
        name = str(dtype).replace("torch.", "")
        name = _DTYPE_NAMES.get(name, name)
        if name in self.flops:
            return self.flops[name]
        return self.flops.get("float32", min(self.flops.values()))

    @classmethod
    def from_json(cls, path) -> "DeviceProfile":
        data = json.loads(Path(path).read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown device profile field(s) {unknown}; the fields "
                             f"are {sorted(known)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


def device_names() -> list[str]:
    """The built-in profiles."""
    return sorted(p.stem for p in _HERE.glob("*.json"))


def device_profile(device) -> DeviceProfile:
    """A ``DeviceProfile``: itself, a built-in name (``device_names()``) or a JSON file."""
    if isinstance(device, DeviceProfile):
        return device
    path = _HERE / f"{str(device).lower()}.json"
    if path.is_file():
        return DeviceProfile.from_json(path)
    if Path(str(device)).is_file():
        return DeviceProfile.from_json(device)
    raise ValueError(f"device={device!r}: not a built-in profile ({', '.join(device_names())}) "
                     "nor a JSON file; build a leancompile.sim.DeviceProfile for your own")
