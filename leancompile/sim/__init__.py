"""Predict what rewritten graphs cost on hardware this machine does not have.

``simulate(graphs, device=...)`` (``simulate.py``) runs post-grad graphs, as our passes leave
them, on a model of a device (``devices.py``: a ``DeviceProfile`` per accelerator, the built-in
ones as JSON files with their sources) and returns a ``Timeline``: total, compute, exposed
communication, per-node spans and peak live memory. ``fullscale.py`` traces models at full
size on the meta device under a fake process group, so that no memory or GPU is needed.
"""

from .devices import DeviceProfile, device_names, device_profile
from .simulate import Span, Timeline, exposure, node_cost, simulate

__all__ = ["DeviceProfile", "Span", "Timeline", "device_names", "device_profile", "exposure",
           "node_cost", "simulate"]
