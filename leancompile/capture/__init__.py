"""Capture one Dynamo graph into forward, backward and inference graphs through AOTAutograd,
the pass pipeline and the compiler, with what the LeanGRPO step wrapper needs to know about them.

``capture_graph(gm, example_inputs, ...)`` (called from the Dynamo backend of
``leancompile.lean.LeanStep``) traces the graph once, with gradients, with Inductor's
decompositions and the min-cut partitioner; the inference graph is the forward graph without
what it saves for the backward (``without_saved``). It runs leancompile's pipeline on each
graph and compiles it (``aot_eager``: as it is; ``inductor``: ``compile_fx_inner`` with the
pipeline as its custom post-grad pass). The result, ``StepGraphs``, has the three graphs with
their calling conventions made explicit:

- ``run_forward(args) -> (*outputs, *saved)``
- ``run_backward(saved for the backward, in its order + cotangents) -> one gradient (or None)
  per input``
- ``run_inference(args) -> outputs``

where ``args`` are the flat inputs Dynamo passes (parameters, buffers, arguments, sizes). Runtime
code calls these graphs directly: that is what lets a schedule run the forward now and the
backward later (Retain), or the backward at once with a provisional cotangent (Reweight). Also
recorded: each input's role (its source, whether dim 0 is the batch), what the LeanGRPO stage
found (row layouts of outputs and saved tensors), the bytes the saved tensors hold beyond the
inputs (exactly, as a function of the batch size), a structural fingerprint of what the graph
computes (to match a rollout call with an update call), and any random op.

The modules, one job each (imports run down this list):

- ``assemble.py``: ``capture_graph``, the steps above in order;
- ``step_graphs.py``: ``StepGraphs``, the result;
- ``compile.py``: one graph through the pipeline and ``aot_eager`` or Inductor;
- ``trace.py``: the AOTAutograd trace (``aot_trace``) and ``without_saved``;
- ``conventions.py``: outputs that alias inputs, the backward's saved order, the kept bytes;
- ``fingerprint.py``: structural hashes, the outputs whose gradient flows through the sample;
- ``random_ops.py``: ops that draw random numbers (``RandomOpInGraphError``);
- ``roles.py``: ``InputRole``, each input's role, the batch symbol.
"""

from .assemble import capture_graph
from .random_ops import RANDOM_FIXES, RandomOpInGraphError, without_rng_wrappers
from .roles import InputRole
from .step_graphs import StepGraphs
from .trace import without_saved

__all__ = ["RANDOM_FIXES", "RandomOpInGraphError", "InputRole", "StepGraphs",
           "capture_graph", "without_rng_wrappers", "without_saved"]
