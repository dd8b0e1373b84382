"""``auto``'s measured choice (``leancompile/lean/costs.py``): the verdict's arithmetic on set
figures, and its wiring into ``lean_compile(schedule="auto")`` with the verdict stubbed (host
timings would make the test depend on the machine)."""

import contextlib
import copy

import pytest
import torch

import leancompile
from leancompile.lean.costs import Ledger, host_timed, verdict

MS = 1e-3


def _ledger(**overrides):
    # F0 1 ms a row; 10 kept rows: 30 ms whole, 20 ms of it their forward (F 2 ms a row)
    figures = dict(infer_seconds=16 * MS, infer_rows=16, keep_seconds=30 * MS,
                   forward_seconds=20 * MS, kept_rows=10, serve_seconds=2 * MS, served_rows=5,
                   gather_seconds=3 * MS, update_calls=3, timed=True, graphs=(1, 3))
    figures.update(overrides)
    return Ledger(**figures)


def test_the_verdict_weighs_what_keeping_cost_against_the_forwards_it_saved():
    # cost 30 - 10 x 1 = 20 ms; saved 5 x 2 - 2 - 3 = 5 ms: keeping lost 15 ms
    reason = verdict(_ledger(), (1, 3))
    assert reason is not None and "cost 20.0 ms" in reason and "saved 5.0 ms" in reason
    assert "schedule='retain'" in reason
    # every kept row served, keeping cheap: cost 12 - 10 = 2 ms, saved 20 - 5 = 15 ms
    assert verdict(_ledger(keep_seconds=12 * MS, served_rows=10), (1, 3)) is None
    # a loss under 1 ms, or under a quarter of what was saved, is left to noise
    assert verdict(_ledger(keep_seconds=12 * MS, forward_seconds=5 * MS, served_rows=10,
                           serve_seconds=0.0, gather_seconds=0.0), (1, 3)) is None
    assert verdict(_ledger(keep_seconds=112 * MS, forward_seconds=100 * MS, served_rows=10,
                           serve_seconds=0.0, gather_seconds=0.0), (1, 3)) is None  # 102 vs 100


@pytest.mark.parametrize("change", [dict(infer_rows=0), dict(kept_rows=0), dict(update_calls=0),
                                    dict(timed=False), dict(timed=None), dict(graphs=(1, 2))])
def test_no_verdict_without_a_clean_measurement(change):
    """No inference call (no F0), nothing kept, no update after the rollout (sampled for an
    evaluation: nothing to weigh), a device clock, or a graph captured or compiled in the cycle
    (its calls' times hold the compile): no verdict."""
    assert verdict(_ledger(**change), (1, 3)) is None


def test_host_time_counts_only_on_the_cpu_in_one_process():
    assert host_timed([torch.ones(2), 3])
    assert not host_timed([torch.ones(2), torch.empty(2, device="meta")])


def _loop(model, step=None, *, schedule=None):
    """Two trained sampling steps of 4 rows and one untrained, then the update on the same
    batches, through ``step`` (eager ``model`` without one); returns the gradients."""
    g = torch.Generator().manual_seed(0)
    fn = step or model
    xs = [torch.randn(4, 6, generator=g)]
    rollout = step.rollout(train=2, schedule=schedule) if step else contextlib.nullcontext()
    with rollout, torch.no_grad():
        for _ in range(3):
            xs.append(xs[-1] + 0.1 * fn(xs[-1]))
    model.zero_grad()
    with step.update() if step else contextlib.nullcontext():
        for k in range(2):
            fn(xs[k]).square().mean().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_auto_keeps_nothing_after_a_losing_cycle(monkeypatch):
    """``auto`` keeps for Retain in the cycle after the first whatever the timings (the first
    compiled its graphs: not judged); with the verdict stubbed to "keeping lost", nothing from
    the next rollout on, the verdict as the reason and the gradients still eager autograd's;
    ``rollout(schedule="retain")`` keeps anyway."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6))
    reference = copy.deepcopy(base)
    want = _loop(reference)
    model = copy.deepcopy(base)
    step = leancompile.lean_compile(model, backend="aot_eager", schedule="auto")
    for _ in range(2):  # (the second rollout judges the first cycle, which compiled)
        step.reset_stats()
        torch.testing.assert_close(_loop(model, step), want, rtol=1e-6, atol=1e-7)
        assert step.stats.kept == {"retain": 2} and step.stats.reused_calls == 2
    assert step._state.auto_off is None
    monkeypatch.setattr("leancompile.lean.state.verdict",
                        lambda ledger, graphs: "nothing (auto: stubbed)")
    step.reset_stats()
    torch.testing.assert_close(_loop(model, step), want, rtol=1e-6, atol=1e-7)
    assert step.stats.kept == {"nothing (auto: stubbed)": 2}, step.stats.summary()
    assert step.stats.reused_calls == 0 and step.stats.forwards_run == 2
    step.reset_stats()
    torch.testing.assert_close(_loop(model, step, schedule="retain"), want, rtol=1e-6,
                               atol=1e-7)
    assert step.stats.kept == {"retain": 2} and step.stats.reused_calls == 2
