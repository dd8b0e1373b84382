"""``leancompile demo race``: the time-to-reward race between FlowGRPO's loop under plain
``torch.compile`` and the same loop under ``lean_compile``."""

import pytest
import torch

from leancompile.demos.race import RaceConfig, plot_race, run_race, time_to_reward


def test_time_to_reward_counts_the_earlier_iterations_and_the_scoring_rollout():
    rewards, rollouts, updates = [-0.8, -0.6, -0.4, -0.2], [1.0, 1.5, 2.0, 2.5], [3.0] * 4
    # reached at the third iteration: two whole iterations, then its rollout
    assert time_to_reward(rewards, rollouts, updates, -0.5) == pytest.approx(1 + 3 + 1.5 + 3 + 2)
    assert time_to_reward(rewards, rollouts, updates, -0.8) == pytest.approx(1.0)
    assert time_to_reward(rewards, rollouts, updates, 0.0) is None
    with pytest.raises(ValueError, match="one of each per iteration"):
        time_to_reward(rewards, rollouts[:2], updates, -0.5)


def test_a_short_race_trains_both_loops_alike_and_plots_them(tmp_path):
    """Two iterations on a smaller FLUX (aot_eager: the reuse itself is tested under Inductor
    in test_real_loops and test_lean_step_adversarial): both loops see the same rewards (same
    seeds, on-policy gradients equal up to rounding), every update call of the wrapped loop is
    a reused one, the speed-up is the ratio of the two times to reward, and the plot is
    written."""
    config = RaceConfig(iterations=2, threshold=-10.0, backend="aot_eager",
                        attention_head_dim=16, prompts=2, group_size=2, sample_batch=4,
                        train_batch=2, num_inference_steps=3)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        race = run_race(config, log=lambda *a: None)
    finally:
        torch.set_num_threads(previous)
    plain, lean = race["loops"]["plain"], race["loops"]["lean"]
    assert len(plain["rewards"]) == len(lean["rewards"]) == 2
    torch.testing.assert_close(torch.tensor(lean["rewards"]), torch.tensor(plain["rewards"]),
                               rtol=1e-4, atol=1e-5)
    assert max(race["param_rel_l2"]) < 1e-4, race["param_rel_l2"]
    # 2 iterations x 4 samples x 2 trained steps in train batches of 2
    assert race["stats"]["reused_calls"] == race["stats"]["update_calls"] == 8, race["stats"]
    assert race["stats"]["forwards_run"] == 0
    assert plain["time_to_reward"] == pytest.approx(plain["rollout_times"][0])
    assert race["speedup"] == pytest.approx(plain["time_to_reward"] / lean["time_to_reward"])
    assert plot_race(race, tmp_path / "race.png")
    assert (tmp_path / "race.png").stat().st_size > 10_000
