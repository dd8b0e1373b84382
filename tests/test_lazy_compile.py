"""Each captured graph compiles on its first run (``StepGraphs.compile``): an update whose
calls all reuse the rollout's compiles nothing of its own graph, a graph first run under
``torch.inference_mode()`` compiles and gives eager's values, and ``plan()`` compiles every
graph it returns (what ``explain`` reads)."""

import pytest
import torch

import leancompile
from test_lean_step import _gaussian_step, _sampling_step


def _eager_grad(layer, step_fn, x, sample):
    layer.zero_grad()
    (step_fn(x, prev_sample=sample)[1] * torch.arange(4.0)).sum().backward()
    return layer.weight.grad.clone()


@pytest.mark.parametrize("compiler", ["inductor", "aot_eager"])
def test_an_update_that_reuses_compiles_nothing_of_its_own_graph(compiler):
    layer, step_fn, x, noise, step = _sampling_step(compiler)

    def update(sample):
        layer.zero_grad()
        with step.update():
            _, log_prob = step(x, prev_sample=sample)
            (log_prob * torch.arange(4.0)).sum().backward()
        return layer.weight.grad.clone()

    with step.rollout(), torch.no_grad():
        sample, _ = step(x, noise=noise)
    got = update(sample)
    assert step.stats.reused_calls == 1 and step.stats.forwards_run == 0, step.stats.summary()
    rollout_graph, update_graph = step.graphs
    # The rollout's trained call ran the forward, the update its backward; no call ran
    # without gradients, and the update ran nothing of its own graph.
    assert rollout_graph.compiled == {"forward", "backward"}, rollout_graph.compiled
    assert update_graph.compiled == set(), update_graph.compiled
    reference = _eager_grad(layer, step_fn, x, sample)
    torch.testing.assert_close(got, reference, rtol=1e-6, atol=1e-6)
    # Nothing kept: the update recomputes, compiling its graph's forward and backward then.
    step.discard_kept()
    torch.testing.assert_close(update(sample), reference, rtol=1e-6, atol=1e-6)
    assert update_graph.compiled == {"forward", "backward"}, update_graph.compiled
    assert step.stats.forwards_run == 1, step.stats.summary()


def test_a_first_run_under_inference_mode_compiles_and_gives_eagers_values():
    layer, step_fn, x, noise, step = _sampling_step("inductor")
    with torch.inference_mode():
        got = step(x, noise=noise)
        want = step_fn(x, noise=noise)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    graph, = step.graphs
    assert graph.compiled == {"inference"}, graph.compiled
    # A call under autograd (Dynamo captures it anew: it guards on inference mode) runs and
    # compiles that graph's forward and backward.
    sample, log_prob = step(x, noise=noise)
    layer.zero_grad()
    log_prob.sum().backward()
    got_grad = layer.weight.grad.clone()
    layer.zero_grad()
    step_fn(x, noise=noise)[1].sum().backward()
    torch.testing.assert_close(got_grad, layer.weight.grad, rtol=1e-6, atol=1e-6)
    assert step.graphs[-1].compiled >= {"forward", "backward"}, step.graphs[-1].compiled


def test_plan_compiles_every_graph_it_returns():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    step = leancompile.lean_compile(_gaussian_step(layer, detach_in_log_prob=True),
                                    backend="aot_eager", schedule="retain", sample_output=0,
                                    sample_arg="prev_sample")
    graph, = step.plan(torch.randn(4, 8), noise=torch.randn(4, 8))
    assert graph.compiled == {"forward", "backward", "inference"}, graph.compiled
    assert graph.layouts.get("row_local") is True, graph.layouts
    assert graph.report is not None and {g.phase for g in graph.report.graphs} == {
        "forward", "backward", "inference"}, graph.report
