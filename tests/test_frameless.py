"""``runtime/frameless.py``: aten graphs that run without a Python frame per op, bitwise equal to
the graph they came from, and the LeanGRPO runtime's ``aot_eager`` graphs run that way."""

from __future__ import annotations

import sys

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from leancompile.runtime.frameless import frameless
from models import ToyFlowPolicy

_OP_CALL = torch._ops.OpOverload.__call__.__code__


def _op_frames(fn, *args, **kwargs) -> dict:
    """Python frames of ``OpOverload.__call__`` pushed while ``fn(*args)`` runs, counted by the
    file of the frame that called them."""
    calls: dict = {}

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is _OP_CALL:
            caller = frame.f_back.f_code.co_filename
            calls[caller] = calls.get(caller, 0) + 1

    sys.setprofile(profile)
    try:
        out = fn(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return calls, out


def _f(x, w, b):
    h = torch.nn.functional.gelu(torch.addmm(b, x, w), approximate="tanh")
    return h.sum(dim=0, keepdim=True), [torch.softmax(h, -1), x.new_zeros(2)]


def test_frameless_is_bitwise_the_graph_and_pushes_no_frame_per_op():
    x, w, b = torch.randn(6, 5), torch.randn(5, 7), torch.randn(7)
    gm = make_fx(_f)(x, w, b)
    code = gm.code
    fast = frameless(gm)

    calls, expected = _op_frames(gm, x, w, b)
    assert sum(calls.values()) >= 5  # the fx graph calls every op through a Python frame
    calls, got = _op_frames(fast, x, w, b)
    assert calls == {}
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1][0], expected[1][0])
    assert got[1][1].shape == (2,)  # the pytree output structure is kept
    assert torch.equal(got[0], _f(x, w, b)[0])
    assert gm.code == code  # the input graph module is untouched
    assert "torch.ops.aten" in code and "torch.ops.aten" not in fast.code


def test_a_graph_without_aten_calls_comes_back_as_it_is():
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    assert frameless(gm) is gm


def test_the_lean_grpo_runtime_runs_its_aot_eager_graphs_frameless():
    """Rollouts and updates of the trainer under ``aot_eager`` (retain, and reweight with its
    vectorised per-row backward, a graph of its own): no op of a generated graph goes through a
    Python frame, and the gradients are those of recompute."""
    from leancompile.grpo.trainer import GRPOConfig, GRPOTrainer

    policy = ToyFlowPolicy(steps=4)
    config = GRPOConfig(sde="flow_grpo", eta=0.9, group_size=4, compiler="aot_eager")
    trainer = GRPOTrainer(policy, lambda latents, conditions: latents.mean(1), None, config)
    conditions = policy.example_conditions(1, torch.Generator().manual_seed(1))
    results = {}
    for schedule in ("recompute", "retain", "reweight"):
        trainer.compute_gradients(conditions, torch.Generator().manual_seed(0),
                                  schedule=schedule)  # captures and compiles
        calls, results[schedule] = _op_frames(
            trainer.compute_gradients, conditions, torch.Generator().manual_seed(0),
            schedule=schedule)
        generated = {f: n for f, n in calls.items() if f.startswith("<eval_with_key>")}
        assert generated == {}, (schedule, generated)
    reference = torch.cat([g.flatten() for g in results["recompute"].grads.values()])
    for schedule in ("retain", "reweight"):
        got = torch.cat([g.flatten() for g in results[schedule].grads.values()])
        assert ((got - reference).norm() / reference.norm()).item() <= 1e-5, schedule
