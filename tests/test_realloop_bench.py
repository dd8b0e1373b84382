"""``leancompile bench realloop``'s arithmetic: the loop's counts per epoch from FlowGRPO's
config, the ideal ratio, and the hooks that time the compiled transformer's calls inside the
loop. (The bench itself compiles six loops; it is run by hand, figures in docs/measured.md.)"""

import pytest
import torch

from leancompile.benchmarks.realloop import _CallTimer, _loop_counts, ideal_ratio
from leancompile.demos.real_loops.flow_grpo_sd3 import FlowGRPOConfig


def test_loop_counts_follow_the_scripts_config():
    # 2 sampling batches x 4 steps; 3 trained steps (timestep_fraction 0.99 of 4) per batch;
    # accumulation over one batch's 3 calls: 2 optimizer steps, the first window 3 calls.
    assert _loop_counts(FlowGRPOConfig()) == {"sampling_calls": 8, "trained_calls": 6,
                                              "first_window_calls": 3, "optimizer_steps": 2}
    # One optimizer step per epoch: every trained call is in the first window.
    assert _loop_counts(FlowGRPOConfig(gradient_accumulation_steps=2))[
        "first_window_calls"] == 6
    # Two inner epochs: the second pass over the samples comes after the first step.
    counts = _loop_counts(FlowGRPOConfig(num_inner_epochs=2, gradient_accumulation_steps=2))
    assert counts["trained_calls"] == 12 and counts["first_window_calls"] == 6


def test_ideal_ratio_saves_one_no_grad_forward_per_reused_call():
    assert ideal_ratio(1.0, 0.1, 3) == pytest.approx(1 / 0.7)
    assert ideal_ratio(1.0, 0.1, 0) == 1.0
    with pytest.raises(ValueError, match="not within the plain epoch"):
        ideal_ratio(0.2, 0.1, 3)


def test_call_timer_splits_sampling_and_trained_calls():
    module = torch.compile(torch.nn.Linear(4, 4), backend="eager")
    timer = _CallTimer(module)
    x = torch.randn(2, 4)
    module.eval()
    with torch.no_grad():
        module(x)
        module(x)
    module.train()
    module(x).sum().backward()
    with torch.no_grad():  # the KL reference: no grad, train mode, not a sampling call
        module(x)
    assert len(timer.sampling) == 2 and len(timer.trained) == 1
    assert all(t > 0 for t in timer.sampling + timer.trained)
    timer.clear()
    assert timer.sampling == [] and timer.trained == []
