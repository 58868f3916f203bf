"""Advantage estimators: registry vs. the config's names, hand-computed cases, masking and group properties."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridrl.algos import advantages as adv
from hybridrl.algos.advantages import ADV_ESTIMATORS, compute_advantages, get_adv_estimator, required_inputs
from hybridrl.algos.masked import masked_mean, masked_var
from hybridrl.config.schema import ADV_ESTIMATORS as CONFIG_ESTIMATORS
from hybridrl.config.schema import CRITIC_ESTIMATORS, GROUP_ESTIMATORS

SETTINGS = settings(max_examples=30, deadline=None)


def outcome(scores: list[float], lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded float64 ``(rewards, mask)`` with each score on its response's last token."""
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).double()
    rewards = torch.zeros(len(scores), width, dtype=torch.float64)
    for i, (s, n) in enumerate(zip(scores, lengths, strict=True)):
        rewards[i, n - 1] = s
    return rewards, mask


@st.composite
def padded_batches(draw, max_batch: int = 6, max_len: int = 7):
    """Random ``(rewards, values, mask)`` with arbitrary (not only right-padded) masks."""
    b, r = draw(st.integers(1, max_batch)), draw(st.integers(1, max_len))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mask = (torch.rand(b, r, generator=g) < draw(st.floats(0.3, 1.0))).float()
    return (
        torch.randn(b, r, generator=g, dtype=torch.float64),
        torch.randn(b, r, generator=g, dtype=torch.float64),
        mask,
    )


# --- registry ------------------------------------------------------------------------------------------


def test_registry_matches_config_names():
    assert set(ADV_ESTIMATORS) == set(CONFIG_ESTIMATORS)


def test_declared_inputs_match_config_groups():
    """The config's "needs a critic" / "needs groups" lists agree with what each estimator asks for."""
    assert {n for n in ADV_ESTIMATORS if "values" in required_inputs(n)} == set(CRITIC_ESTIMATORS)
    assert {n for n in ADV_ESTIMATORS if "index" in required_inputs(n)} == set(GROUP_ESTIMATORS)


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError, match="adv_estimator") as err:
        get_adv_estimator("ppo")
    message = str(err.value)
    assert "\n" not in message and "'ppo'" in message
    assert all(name in message for name in ADV_ESTIMATORS)


def test_register_rejects_duplicates_and_unknown_inputs():
    with pytest.raises(ValueError, match="already registered"):
        adv.register_adv_estimator("gae")(lambda token_level_rewards: None)
    with pytest.raises(ValueError, match="asks for"):
        adv.register_adv_estimator("new")(lambda token_level_rewards, reward_model: None)
    assert "new" not in ADV_ESTIMATORS


def test_compute_advantages_checks_inputs():
    rewards, mask = outcome([1.0, 0.0], [2, 3], 3)
    with pytest.raises(ValueError, match=r"'gae' needs \['values'\]"):
        compute_advantages("gae", token_level_rewards=rewards, response_mask=mask, values=None)
    with pytest.raises(TypeError, match="unknown inputs"):
        compute_advantages("grpo", token_level_rewards=rewards, response_mask=mask, index=[0, 0], lamb=0.9)


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_every_estimator_through_compute_advantages(name):
    """One call with everything the trainer has; shapes, finiteness and zero padding."""
    g = torch.Generator().manual_seed(0)
    rewards, mask = outcome([1.0, 0.0, 0.5, 1.0], [3, 1, 4, 2], 5)
    inputs = dict(
        token_level_rewards=rewards,
        response_mask=mask,
        values=torch.randn(4, 5, generator=g, dtype=torch.float64),
        index=np.array(["p0", "p0", "p1", "p1"], dtype=object),
        reward_baselines=torch.tensor([0.5, 0.5, 0.0, 0.0]),
        gamma=0.99,
        lam=0.95,
        norm_adv_by_std_in_grpo=True,
        pass_k=2,
        pass_threshold=1.0,
        epsilon=1e-6,
        whiten=True,
    )
    advantages, returns = compute_advantages(name, **inputs)
    assert advantages.shape == returns.shape == (4, 5)
    assert torch.isfinite(advantages).all() and torch.isfinite(returns).all()
    assert (advantages[mask == 0] == 0).all() and (returns[mask == 0] == 0).all()


# --- gae -----------------------------------------------------------------------------------------------


def test_gae_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.25, 0.5]])
    a, r = adv.gae(rewards, values, torch.ones(1, 3), gamma=0.5, lam=0.5, whiten=False)
    # t=2: delta 0.5; t=1: delta 0 + 0.25*0.5; t=0: delta -0.375 + 0.25*0.125
    torch.testing.assert_close(a, torch.tensor([[-0.34375, 0.125, 0.5]]))
    torch.testing.assert_close(r, torch.tensor([[0.15625, 0.375, 1.0]]))


@given(padded_batches())
@SETTINGS
def test_gae_gamma_lam_one_is_reward_to_go_minus_values(batch):
    rewards, values, _ = batch
    mask = torch.ones_like(rewards)
    a, r = adv.gae(rewards, values, mask, gamma=1.0, lam=1.0, whiten=False)
    reward_to_go = rewards.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(r, reward_to_go)
    torch.testing.assert_close(a, reward_to_go - values)


@given(padded_batches(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
@SETTINGS
def test_gae_skips_masked_positions(batch, gamma, lam):
    """Padding never leaks: the result on a row equals GAE on the row with its masked positions removed."""
    rewards, values, mask = batch
    a, r = adv.gae(rewards, values, mask, gamma=gamma, lam=lam, whiten=False)
    assert (a[mask == 0] == 0).all() and (r[mask == 0] == 0).all()
    for i in range(rewards.shape[0]):
        keep = mask[i].bool()
        if keep.any():
            ones = torch.ones(1, int(keep.sum()))
            a_i, r_i = adv.gae(rewards[i, keep][None], values[i, keep][None], ones, gamma=gamma, lam=lam, whiten=False)
            torch.testing.assert_close(a[i, keep], a_i[0])
            torch.testing.assert_close(r[i, keep], r_i[0])


def test_gae_whitening_over_valid_tokens():
    rewards, mask = outcome([1.0, 0.0, 2.0], [2, 4, 3], 5)
    values = torch.linspace(-1, 1, 15, dtype=torch.float64).reshape(3, 5)
    a, r = adv.gae(rewards, values, mask, gamma=0.9, lam=0.8, whiten=True)
    raw, r_raw = adv.gae(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    torch.testing.assert_close(r, r_raw)  # returns stay raw critic targets
    assert abs(float(masked_mean(a, mask))) < 1e-6 and abs(float(masked_var(a, mask)) - 1) < 1e-4
    torch.testing.assert_close(a[mask.bool()], (raw[mask.bool()] - raw[mask.bool()].mean()) / raw[mask.bool()].std())


# --- group estimators -----------------------------------------------------------------------------------


def test_grpo_hand_computed_and_dr_grpo():
    rewards, mask = outcome([1.0, 0.0, 1.0, 2.0, 3.0], [1, 2, 3, 2, 1], 3)
    index = np.array(["a", "a", "b", "b", "b"])
    a, r = adv.grpo(rewards, mask, index, epsilon=0.0)
    s = 0.5**0.5
    expected = torch.tensor([s, -s, -1.0, 0.0, 1.0], dtype=torch.float64)[:, None] * mask
    torch.testing.assert_close(a, expected)
    assert r is a
    dr, _ = adv.grpo(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(dr, torch.tensor([0.5, -0.5, -1.0, 0.0, 1.0], dtype=torch.float64)[:, None] * mask)


def test_grpo_single_member_group_keeps_raw_score():
    rewards, mask = outcome([0.7, 1.0, 0.0], [1, 1, 1], 1)
    a, _ = adv.grpo(rewards, mask, [9, 4, 4], epsilon=0.0)
    torch.testing.assert_close(a[:, 0], torch.tensor([0.7, 2**-0.5, -(2**-0.5)], dtype=torch.float64))


@given(st.lists(st.integers(0, 3), min_size=2, max_size=16), st.integers(0, 2**31 - 1))
@SETTINGS
def test_grpo_groups_sum_to_zero_with_unit_std(groups, seed):
    g = torch.Generator().manual_seed(seed)
    n = len(groups)
    lengths = torch.randint(1, 5, (n,), generator=g).tolist()
    rewards, mask = outcome(torch.randn(n, generator=g, dtype=torch.float64).tolist(), lengths, 4)
    as_numpy, _ = adv.grpo(rewards, mask, np.array(groups), epsilon=0.0)
    as_tensor, _ = adv.grpo(rewards, mask, torch.tensor(groups), epsilon=0.0)
    torch.testing.assert_close(as_numpy, as_tensor)
    seq_adv = as_numpy[:, 0]
    for gid in set(groups):
        members = seq_adv[torch.tensor(groups) == gid]
        if len(members) > 1:
            assert abs(float(members.sum())) < 1e-4
            assert abs(float(members.std()) - 1.0) < 1e-3
    assert torch.allclose(as_numpy, seq_adv[:, None] * mask)  # one value per response, on its tokens


@given(st.lists(st.integers(0, 2), min_size=2, max_size=12), st.integers(0, 2**31 - 1))
@SETTINGS
def test_rloo_baseline_is_mean_of_the_others(groups, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(len(groups), generator=g, dtype=torch.float64)
    rewards, mask = outcome(scores.tolist(), [2] * len(groups), 3)
    a, _ = adv.rloo(rewards, mask, np.array(groups))
    for i, gid in enumerate(groups):
        others = [scores[j] for j, h in enumerate(groups) if h == gid and j != i]
        expected = scores[i] - sum(others) / len(others) if others else scores[i]
        torch.testing.assert_close(a[i, :2], torch.full((2,), float(expected), dtype=torch.float64))
        assert a[i, 2] == 0


def test_reinforce_plus_plus_discounted_then_whitened():
    rewards = torch.tensor([[1.0, 0.0, 2.0, 5.0], [0.0, 3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    a, r = adv.reinforce_plus_plus(rewards, mask, gamma=0.5)
    torch.testing.assert_close(r, torch.tensor([[1.5, 1.0, 2.0, 0.0], [1.5, 3.0, 0.0, 0.0]]))
    valid = torch.tensor([1.5, 1.0, 2.0, 1.5, 3.0])
    torch.testing.assert_close(a[mask.bool()], (valid - valid.mean()) / valid.std())
    assert (a[mask == 0] == 0).all()


def test_reinforce_plus_plus_baseline_centres_groups_then_whitens():
    rewards, mask = outcome([1.0, 3.0, 0.0, 4.0], [2, 2, 2, 2], 2)
    a, _ = adv.reinforce_plus_plus_baseline(rewards, mask, ["x", "x", "y", "y"])
    centred = torch.tensor([-1.0, 1.0, -2.0, 2.0], dtype=torch.float64).repeat_interleave(2)
    torch.testing.assert_close(a.reshape(-1), centred / centred.std())


def test_remax_subtracts_greedy_baseline():
    rewards = torch.tensor([[0.0, 0.5, 1.0], [2.0, 0.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    a, r = adv.remax(rewards, mask, torch.tensor([0.25, 1.0]))
    torch.testing.assert_close(r, torch.tensor([[1.5, 1.5, 1.0], [2.0, 0.0, 0.0]]))
    torch.testing.assert_close(a, torch.tensor([[1.25, 1.25, 0.75], [1.0, -1.0, 0.0]]))
