"""The alignment arithmetic (canntrain_core/rlhf/losses.py) against values computed by hand here."""

from __future__ import annotations

import math

import pytest
import torch

from canntrain_core.rlhf.losses import (
    aggregate, clipped_policy_loss, clipped_value_loss, dpo_loss, gae, group_advantages, kl_penalty, masked_whiten,
    pairwise_reward_loss,
)

T = torch.tensor


def test_gae_and_returns_by_hand():
    # gamma 1, lam 0.95; delta_2 = 1 - 0.3, delta_1 = 0.3 - 0.4, delta_0 = 0.4 - 0.5
    adv, ret = gae(T([[0.0, 0.0, 1.0]]), T([[0.5, 0.4, 0.3]]), T([[1.0, 1.0, 1.0]]), 1.0, 0.95)
    assert torch.allclose(adv, T([[-0.1 + 0.95 * (-0.1 + 0.95 * 0.7), -0.1 + 0.95 * 0.7, 0.7]]))
    assert torch.allclose(ret, T([[0.93675, 0.965, 1.0]]))
    # the last token is padding: it has no value, no advantage, and the reward sits on token 1
    adv, _ = gae(T([[0.0, 1.0, 0.0]]), T([[0.5, 0.4, 9.0]]), T([[1.0, 1.0, 0.0]]), 0.9, 0.5)
    assert torch.allclose(adv, T([[(0.9 * 0.4 - 0.5) + 0.9 * 0.5 * 0.6, 1.0 - 0.4, 0.0]]))


def test_masked_whitening_by_hand():
    out = masked_whiten(T([1.0, 2.0, 3.0, 100.0]), T([1.0, 1.0, 1.0, 0.0]))
    s = math.sqrt(2 / 3)  # population std of 1, 2, 3
    assert torch.allclose(out, T([-1 / s, 0.0, 1 / s, 0.0]), atol=1e-6)


@pytest.mark.parametrize("adv, ratio, want, binds", [
    (1.0, 1.5, -1.2, True),    # gain capped at 1 + eps
    (-1.0, 1.5, 1.5, False),   # a loss is never capped from below
    (1.0, 0.5, -0.5, False),
    (-1.0, 0.5, 0.8, True),    # the ratio may not fall below 1 - eps on a negative advantage
    (1.0, 1.1, -1.1, False),   # inside the clip range
])
def test_clipped_policy_loss_on_each_side(adv, ratio, want, binds):
    loss, frac = clipped_policy_loss(T([[math.log(ratio)]]), T([[0.0]]), T([[adv]]), T([[1.0]]), 0.2)
    assert loss.item() == pytest.approx(want) and frac.item() == float(binds)


def test_asymmetric_clip_range_dapo():
    loss, _ = clipped_policy_loss(T([[math.log(1.5)]]), T([[0.0]]), T([[1.0]]), T([[1.0]]), 0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-1.28)


@pytest.mark.parametrize("v, want", [(2.0, 2.0), (0.2, 0.125), (1.2, 0.72)])
def test_clipped_value_loss(v, want):
    # old value 1, return 0, clip 0.5: 0.5 max((v - 0)^2, (clip(v, 0.5, 1.5) - 0)^2)
    assert clipped_value_loss(T([[v]]), T([[1.0]]), T([[0.0]]), T([[1.0]]), 0.5).item() == pytest.approx(want)


def test_kl_is_zero_when_the_policy_is_the_reference():
    logp = T([[-1.0, -2.5, -0.1]])
    assert torch.equal(kl_penalty(logp, logp, "k1"), torch.zeros(1, 3))
    assert torch.equal(kl_penalty(logp, logp, "k3"), torch.zeros(1, 3))
    assert kl_penalty(T([[-1.0]]), T([[-2.0]]), "k3").item() == pytest.approx(math.exp(-1) + 1 - 1)


def test_dpo_loss_closed_form():
    loss, margin = dpo_loss(T([-1.0]), T([-2.0]), T([-1.5]), T([-1.5]), beta=0.1)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-0.1)))  # h = 0.5 - (-0.5) = 1
    assert margin.item() == pytest.approx(0.1)
    smoothed, _ = dpo_loss(T([-1.0]), T([-2.0]), T([-1.5]), T([-1.5]), beta=0.1, label_smoothing=0.1)
    assert smoothed.item() == pytest.approx(0.9 * math.log(1 + math.exp(-0.1)) + 0.1 * math.log(1 + math.exp(0.1)))


def test_group_advantages_including_a_group_of_equal_rewards():
    adv = group_advantages(T([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5]), group_size=4)
    s = math.sqrt(1 / 3)  # sample std of 1, 0, 0, 1
    assert torch.allclose(adv[:4], T([0.5, -0.5, -0.5, 0.5]) / (s + 1e-4))
    assert torch.equal(adv[4:], torch.zeros(4))  # all equal: nothing to learn from this prompt


def test_loss_aggregations():
    per_token, mask = T([[1.0, 1.0, 0.0], [4.0, 0.0, 0.0]]), T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate(per_token, mask, "grpo").item() == pytest.approx((1 + 4) / 2)  # per response, then mean
    assert aggregate(per_token, mask, "dapo").item() == pytest.approx(6 / 3)  # per token
    assert aggregate(per_token, mask, "dr_grpo").item() == pytest.approx(6 / (2 * 3))  # / (B x max length)


def test_pairwise_reward_loss():
    assert pairwise_reward_loss(T([2.0]), T([0.0])).item() == pytest.approx(math.log(1 + math.exp(-2)))
