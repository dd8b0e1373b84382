"""Group advantages and timestep selection (leancompile.grpo.advantages / .timesteps), checked
against hand-computed values and numpy re-statements of the baselines' formulas."""

import math

import numpy as np
import pytest
import torch

from leancompile.grpo.advantages import AdvantageConfig, group_advantages, group_ids_for
from leancompile.grpo.timesteps import (TimestepSelection, same_noise_latents,
                                        select_timesteps)

# ---------------------------------------------------------------- advantages


def test_group_ids_for_is_prompt_major():
    assert group_ids_for(3, 2).tolist() == [0, 0, 1, 1, 2, 2]
    assert group_ids_for(1, 4).dtype == torch.int64
    with pytest.raises(ValueError, match="group_size=0"):
        group_ids_for(2, 0)


def test_per_group_advantages_by_hand():
    # groups {1, 2} and {3, 4}: mean 1.5 / 3.5, biased std 0.5 each
    adv = group_advantages(torch.tensor([1.0, 2.0, 3.0, 4.0]), group_ids_for(2, 2))
    expected = 0.5 / (0.5 + 1e-4)
    torch.testing.assert_close(adv, torch.tensor([-expected, expected, -expected, expected]))
    assert adv.dtype == torch.float32


def test_global_std_keeps_group_means():
    # same rewards, std over the batch: np.std([1, 2, 3, 4]) = sqrt(1.25)
    adv = group_advantages(torch.tensor([1.0, 2.0, 3.0, 4.0]), group_ids_for(2, 2),
                           AdvantageConfig(global_std=True))
    d = 0.5 / (math.sqrt(1.25) + 1e-4)
    torch.testing.assert_close(adv, torch.tensor([-d, d, -d, d]))


def test_matches_flow_grpo_stat_tracker_formula_on_scattered_groups():
    # FlowGRPO groups by prompt wherever the rows are; restated with numpy (np.std, ddof=0)
    rewards = np.array([0.3, 1.7, 0.9, 2.5, 0.1, 1.1, 4.0, 0.2])
    prompts = np.array([2, 0, 2, 1, 0, 1, 2, 0])
    for global_std in (False, True):
        expected = np.empty_like(rewards)
        for p in np.unique(prompts):
            group = rewards[prompts == p]
            std = (np.std(rewards) if global_std else np.std(group)) + 1e-4
            expected[prompts == p] = (group - np.mean(group)) / std
        adv = group_advantages(torch.tensor(rewards), torch.tensor(prompts),
                               AdvantageConfig(global_std=global_std))
        torch.testing.assert_close(adv, torch.tensor(np.clip(expected, -5, 5),
                                                     dtype=torch.float32))


def test_dance_grpo_settings_use_unbiased_std():
    # DanceGRPO: torch.std (unbiased) + 1e-8 per group of num_generations
    rewards = torch.tensor([1.0, 2.0, 4.0, 10.0, 10.0, 13.0])
    adv = group_advantages(rewards, group_ids_for(2, 3),
                           AdvantageConfig(unbiased=True, eps=1e-8))
    expected = torch.cat([(g - g.mean()) / (g.std() + 1e-8) for g in rewards.view(2, 3)])
    torch.testing.assert_close(adv, expected)
    with pytest.raises(ValueError, match=r"groups \[7\] have a single sample"):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 7]),
                         AdvantageConfig(unbiased=True))


def test_clamp_and_constant_group():
    # one 49 among 49 zeros: mean 0.98, biased std sqrt(47.0596) = 6.86, (49 - 0.98)/6.86 = 7
    rewards = torch.zeros(50)
    rewards[0] = 49.0
    adv = group_advantages(rewards, torch.zeros(50, dtype=torch.long))
    assert adv[0] == 5.0
    torch.testing.assert_close(adv[1:], torch.full((49,), -0.98 / (6.86 + 1e-4)))
    adv = group_advantages(rewards, torch.zeros(50, dtype=torch.long),
                           AdvantageConfig(adv_clip_max=2.0))
    assert adv[0] == 2.0
    # a group whose rewards are all equal gets 0, not NaN
    adv = group_advantages(torch.tensor([3.0, 3.0, 1.0, 2.0]), group_ids_for(2, 2))
    assert adv[:2].tolist() == [0.0, 0.0]


def test_non_finite_rewards_are_named():
    rewards = torch.arange(8, dtype=torch.float32)
    rewards[3] = float("nan")
    rewards[7] = float("inf")
    with pytest.raises(ValueError, match=r"rewards of samples \[3, 7\] are not finite: "
                                         r"\[nan, inf\]"):
        group_advantages(rewards, group_ids_for(4, 2))


def test_advantage_input_validation():
    with pytest.raises(ValueError, match="shaped like rewards"):
        group_advantages(torch.zeros(4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="integer tensor"):
        group_advantages(torch.zeros(4), torch.zeros(4))
    with pytest.raises(ValueError, match="adv_clip_max=0"):
        AdvantageConfig(adv_clip_max=0)
    with pytest.raises(ValueError, match="eps=0"):
        AdvantageConfig(eps=0)
    with pytest.raises(TypeError):
        AdvantageConfig(True)  # keyword-only


def test_advantage_defaults_are_flow_grpo_values():
    config = AdvantageConfig()
    assert (config.global_std, config.adv_clip_max, config.eps, config.unbiased) == (
        False, 5.0, 1e-4, False)


# ---------------------------------------------------------------- timestep selection


def test_first_takes_int_of_steps_times_fraction():
    sel = select_timesteps(TimestepSelection(strategy="first", fraction=0.99), batch=3,
                           num_steps=10)
    assert sel.shape == (3, 9) and sel.dtype == torch.int64   # int(10 * 0.99) == 9
    assert (sel == torch.arange(9)).all()
    full = select_timesteps(TimestepSelection(), batch=2, num_steps=4)
    assert full.tolist() == [[0, 1, 2, 3]] * 2


def test_dance_grpo_subset_per_sample():
    config = TimestepSelection(strategy="dance_grpo", fraction=0.6)
    g = torch.Generator().manual_seed(0)
    sel = select_timesteps(config, batch=64, num_steps=16, generator=g)
    assert sel.shape == (64, 9)                          # int((16 - 1) * 0.6) == 9
    assert (sel >= 0).all() and (sel < 15).all()         # never the last step
    assert (sel[:, 1:] > sel[:, :-1]).all()              # sorted, distinct
    assert len({tuple(row) for row in sel.tolist()}) > 1  # rows differ
    counts = torch.bincount(sel.flatten(), minlength=15)
    assert (counts > 0).all()                            # every candidate step gets used
    again = select_timesteps(config, batch=64, num_steps=16,
                             generator=torch.Generator().manual_seed(0))
    assert torch.equal(sel, again)
    every = select_timesteps(TimestepSelection(strategy="dance_grpo"), batch=2, num_steps=5)
    assert every.tolist() == [[0, 1, 2, 3]] * 2


def test_window_is_contiguous_and_inside_its_range():
    config = TimestepSelection(strategy="window")        # size 3 in (0, num_steps // 2)
    starts = set()
    for seed in range(40):
        sel = select_timesteps(config, batch=4, num_steps=10,
                               generator=torch.Generator().manual_seed(seed))
        assert sel.shape == (4, 3)
        assert (sel == sel[:1]).all()                    # one window shared by the call
        assert (sel[0] == sel[0, 0] + torch.arange(3)).all()
        starts.add(int(sel[0, 0]))
    assert starts == {0, 1, 2}                           # randint(0, 5 - 3), inclusive

    per_sample = TimestepSelection(strategy="window", window_size=2, window_range=(1, 9),
                                   window_per_sample=True)
    sel = select_timesteps(per_sample, batch=200, num_steps=10,
                           generator=torch.Generator().manual_seed(1))
    assert (sel[:, 1] == sel[:, 0] + 1).all()
    assert set(sel[:, 0].tolist()) == set(range(1, 8))
    assert torch.equal(sel, select_timesteps(per_sample, batch=200, num_steps=10,
                                             generator=torch.Generator().manual_seed(1)))


def test_selection_errors_give_the_fix():
    with pytest.raises(ValueError, match=r"fraction=0 must be in \(0, 1\]"):
        TimestepSelection(fraction=0)
    with pytest.raises(ValueError, match="fraction=1.5"):
        TimestepSelection(strategy="dance_grpo", fraction=1.5)
    with pytest.raises(ValueError, match=r"int\(10 \* 0.05\) = 0 steps; use fraction >= "
                                         r"1/num_steps = 0.1"):
        select_timesteps(TimestepSelection(fraction=0.05), batch=1, num_steps=10)
    with pytest.raises(ValueError, match=r"int\(\(4 - 1\) \* 0.3\) = 0"):
        select_timesteps(TimestepSelection(strategy="dance_grpo", fraction=0.3), batch=1,
                         num_steps=4)
    with pytest.raises(ValueError, match="strategy='bogus'"):
        TimestepSelection(strategy="bogus")
    with pytest.raises(ValueError, match="only apply to strategy='window'"):
        TimestepSelection(strategy="first", window_size=2)
    with pytest.raises(ValueError, match="no effect with strategy='window'"):
        TimestepSelection(strategy="window", fraction=0.5)
    with pytest.raises(ValueError, match=r"window_range=\(2, 3\) cannot hold a window of 2"):
        TimestepSelection(strategy="window", window_size=2, window_range=(2, 3))
    with pytest.raises(ValueError, match=r"num_steps=4 cannot hold a window of 3 .*"
                                         r"window_range=\(0, 3\)"):
        select_timesteps(TimestepSelection(strategy="window"), batch=1, num_steps=4)
    with pytest.raises(ValueError, match="batch=0"):
        select_timesteps(TimestepSelection(), batch=0, num_steps=4)


def test_same_noise_latents_layout():
    initial = torch.arange(2 * 3, dtype=torch.float32).reshape(2, 3)
    out = same_noise_latents(initial, 3)
    assert out.shape == (6, 3)
    ids = group_ids_for(2, 3)
    for b in range(6):
        assert torch.equal(out[b], initial[ids[b]])
    with pytest.raises(ValueError, match="group_size=0"):
        same_noise_latents(initial, 0)
