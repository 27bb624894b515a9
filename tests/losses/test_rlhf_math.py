"""The alignment arithmetic (canntrain_core/losses.py) against values computed by hand, and against
TRL's and verl's formulas re-derived here in plain torch on the same fixed batch.

The references below are written out from the peers' code, not imported (neither is a dependency):

- TRL: ``trl/trainer/grpo_trainer.py`` ``GRPOTrainer._compute_loss`` (loss_type grpo, bnpo, dr_grpo, dapo;
  the KL term; ``clip_ratio/region_mean``) and ``_generate_and_score_completions`` (group advantages,
  ``num_items_in_batch``), TRL 0.20 to 1.1.0.dev0; ``PPOTrainer`` (``trl/experimental/ppo/ppo_trainer.py``
  in 1.x: the GAE loop, ``masked_whiten``, ``vf_clipfrac``, ``pg_clipfrac``, ``kl_estimator``) and
  ``trl/trainer/utils.py`` ``masked_var(unbiased=True)``.
- verl: ``verl/trainer/ppo/core_algos.py`` (``agg_loss`` with ``dp_size``/``batch_num_tokens``/
  ``loss_scale_factor``, ``compute_policy_loss_vanilla``, ``compute_value_loss``, ``kl_penalty_forward``,
  the mask-aware ``compute_gae_advantage_return``, ``compute_grpo_outcome_advantage``) and
  ``verl/utils/torch_functional.py`` (``masked_var`` unbiased, ``masked_whiten``), verl main (2025-26).

The fixed batch is laid out three ways from the same per-token numbers: canntrain's rows (prompt and
response, right-padded: the mask is 0 on the prompt), TRL's completions (padded to the longest one) and
verl's responses (padded to the maximal response length).
"""

from __future__ import annotations

import math

import pytest
import torch

from canntrain_core.losses import (
    aggregate,
    clipped_policy_loss,
    clipped_value_loss,
    dpo_loss,
    gae,
    group_advantages,
    kl_penalty,
    masked_mean,
    masked_var,
    masked_whiten,
    pairwise_reward_loss,
)

T = torch.tensor


# ---------------------------------------------------------------- the fixed batch, three layouts
PROMPTS, RESPONSES, MAX_NEW = (3, 5, 2, 4), (4, 2, 6, 3), 6  # token counts; MAX_NEW = rlhf.generate_max_length
CLIP_LOW, CLIP_HIGH, BETA = 0.2, 0.28, 0.04


def _batch() -> dict:
    g = torch.Generator().manual_seed(0)
    n = sum(RESPONSES)
    logp = -2.0 * torch.rand(n, generator=g) - 0.05
    old = logp + 0.35 * torch.randn(n, generator=g)  # ratios on both sides of the clip range
    ref = logp + 0.5 * torch.randn(n, generator=g)
    values = torch.randn(n, generator=g)
    new_values = values + 0.6 * torch.randn(n, generator=g)
    returns = values + torch.randn(n, generator=g)
    adv = T([1.3, -0.7, 0.4, -1.1])  # one advantage per response (GRPO)
    return {
        "logp": logp,
        "old": old,
        "ref": ref,
        "values": values,
        "new_values": new_values,
        "returns": returns,
        "adv": adv,
    }


def _canntrain(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """models.rollout.layout: row i is prompt + response, right-padded; target t predicts token t + 1."""
    width = max(p + r for p, r in zip(PROMPTS, RESPONSES)) - 1
    out, mask, at = torch.zeros(len(PROMPTS), width), torch.zeros(len(PROMPTS), width), 0
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        out[i, p - 1 : p - 1 + r] = flat[at : at + r]
        mask[i, p - 1 : p - 1 + r] = 1
        at += r
    return out, mask


def _completions(flat: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's completion tensors (width: the longest completion) or verl's responses (width: the maximal length)."""
    width = width or max(RESPONSES)
    out, mask, at = torch.zeros(len(RESPONSES), width), torch.zeros(len(RESPONSES), width), 0
    for i, r in enumerate(RESPONSES):
        out[i, :r] = flat[at : at + r]
        mask[i, :r] = 1
        at += r
    return out, mask


def _per_token_adv(adv: torch.Tensor) -> torch.Tensor:
    return torch.cat([a.repeat(r) for a, r in zip(adv, RESPONSES)])


# ---------------------------------------------------------------- TRL's formulas
def trl_grpo_loss(
    logp,
    old,
    ref,
    adv,
    mask,
    loss_type,
    beta=BETA,
    max_completion_length=None,
    num_items_in_batch=None,
    num_processes=1,
):
    """GRPOTrainer._compute_loss on [B, C] completion tensors, advantages [B]."""
    per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - CLIP_LOW, 1 + CLIP_HIGH)
    per_token_loss = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None]) + beta * per_token_kl
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    if loss_type == "dapo":
        return (per_token_loss * mask).sum() / (num_items_in_batch / num_processes)
    raise ValueError(loss_type)


def trl_region_clip_ratio(logp, old, adv, mask):
    coef_1 = torch.exp(logp - old)
    low = (coef_1 < 1 - CLIP_LOW) & (adv[:, None] < 0)
    high = (coef_1 > 1 + CLIP_HIGH) & (adv[:, None] > 0)
    return ((low | high).float() * mask).sum() / mask.sum()


def trl_masked_whiten(values, mask):
    """trl.trainer.utils.masked_whiten (shift_mean=True) with masked_var(unbiased=True)."""
    mean = (values * mask).sum() / mask.sum()
    var = (((values - mean) ** 2) * mask).sum() / mask.sum()
    var = var * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def trl_ppo_gae(rewards, values, gamma, lam):
    """PPOTrainer: the plain loop over completion tensors (values zero past the response)."""
    lastgaelam, reversed_ = 0, []
    n = rewards.shape[1]
    for t in reversed(range(n)):
        nextvalues = values[:, t + 1] if t < n - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        reversed_.append(lastgaelam)
    advantages = torch.stack(reversed_[::-1], dim=1)
    return advantages, advantages + values


def trl_group_advantages(rewards, num_generations, scale_rewards):
    mean = rewards.view(-1, num_generations).mean(dim=1).repeat_interleave(num_generations)
    if scale_rewards == "group":
        std = rewards.view(-1, num_generations).std(dim=1).repeat_interleave(num_generations)
    elif scale_rewards == "batch":
        std = rewards.std().expand_as(rewards)
    advantages = rewards - mean
    return advantages if scale_rewards == "none" else advantages / (std + 1e-4)


# ---------------------------------------------------------------- verl's formulas
def verl_agg_loss(
    loss_mat, loss_mask, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None
):
    if mode == "token-mean":
        batch_num_tokens = loss_mask.sum() if batch_num_tokens is None else batch_num_tokens
        return (loss_mat * loss_mask).sum() / batch_num_tokens * dp_size
    seq_mask = (loss_mask.sum(-1) > 0).float()
    global_batch_size = seq_mask.sum() if global_batch_size is None else global_batch_size
    if mode == "seq-mean-token-sum-norm":
        loss = ((loss_mat * loss_mask).sum(-1) * seq_mask).sum() / global_batch_size * dp_size
        return loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    if mode == "seq-mean-token-mean":
        seq = (loss_mat * loss_mask).sum(-1) / (loss_mask.sum(-1) + 1e-8)
        return (seq * seq_mask).sum() / global_batch_size * dp_size
    raise ValueError(mode)


def verl_masked_mean(x, mask):
    return (x * mask).sum() / (mask.sum() + 1e-8)


def verl_policy_loss(old, logp, adv, mask, mode, clip_ratio_c=3.0):
    """compute_policy_loss_vanilla: (pg_loss, pg_clipfrac, ppo_kl), dual clip included."""
    negative_approx_kl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_masked_mean(-negative_approx_kl, mask)
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), mask)
    clip_pg_losses2 = torch.min(-adv * clip_ratio_c, clip_pg_losses1)
    pg_losses = torch.where(adv < 0, clip_pg_losses2, clip_pg_losses1)
    return verl_agg_loss(pg_losses, mask, mode, loss_scale_factor=MAX_NEW), pg_clipfrac, ppo_kl


def verl_kl_penalty(logprob, ref_logprob, kl_penalty):
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    raise NotImplementedError(kl_penalty)


def verl_value_loss(vpreds, returns, values, mask, cliprange_value):
    vpredclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1, vf_losses2 = (vpreds - returns) ** 2, (vpredclipped - returns) ** 2
    vf_loss = 0.5 * verl_agg_loss(torch.max(vf_losses1, vf_losses2), mask, "token-mean")
    return vf_loss, verl_masked_mean(torch.gt(vf_losses2, vf_losses1).float(), mask)


def verl_gae(rewards, values, mask, gamma, lam):
    """compute_gae_advantage_return before whitening: values and TD errors skipped where mask is 0."""
    nextvalues, lastgaelam, reversed_ = 0, 0, []
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        reversed_.append(lastgaelam)
    advantages = torch.stack(reversed_[::-1], dim=1)
    return advantages, advantages + values


def verl_masked_whiten(values, mask):
    mean = verl_masked_mean(values, mask)
    centered = values - mean
    variance = verl_masked_mean(centered**2, mask) * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def verl_grpo_advantages(scores, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    out = scores.clone()
    for idx in set(index):
        rows = [i for i, j in enumerate(index) if j == idx]
        group = scores[rows]
        mean, std = (group.mean(), group.std()) if len(rows) > 1 else (T(0.0), T(1.0))
        out[rows] = (group - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else group - mean
    return out


# ---------------------------------------------------------------- the three layouts agree with the peers
MODES = {
    "grpo": ("grpo", "seq-mean-token-mean"),
    "bnpo": ("bnpo", "token-mean"),
    "dapo": ("dapo", "token-mean"),
    "dr_grpo": ("dr_grpo", "seq-mean-token-sum-norm"),
}


@pytest.mark.parametrize("mode", MODES)
def test_each_loss_aggregation_is_its_trl_and_verl_namesake(mode):
    b = _batch()
    adv = _per_token_adv(b["adv"])
    (logp, mask), (old, _), (ref, _), (a, _) = (
        _canntrain(b[k] if k != "adv" else adv) for k in ("logp", "old", "ref", "adv")
    )
    pg, _ = clipped_policy_loss(logp, old, a, mask, CLIP_LOW, CLIP_HIGH, mode, max_tokens=MAX_NEW)
    ours = pg + BETA * aggregate(kl_penalty(logp, ref, "k3"), mask, mode, max_tokens=MAX_NEW)

    tl, tm = _completions(b["logp"])
    trl = trl_grpo_loss(
        tl,
        _completions(b["old"])[0],
        _completions(b["ref"])[0],
        b["adv"],
        tm,
        MODES[mode][0],
        max_completion_length=MAX_NEW,
        num_items_in_batch=tm.sum(),
    )
    assert ours.item() == pytest.approx(trl.item(), rel=1e-6, abs=1e-7)

    vl, vm = _completions(b["logp"], MAX_NEW)
    vold, vref, va = (_completions(x, MAX_NEW)[0] for x in (b["old"], b["ref"], adv))
    assert (torch.exp(vl - vold) * vm).max() < 3  # verl's dual clip (ratio > 3, A < 0) does not bind here
    pg_verl, _, _ = verl_policy_loss(vold, vl, va, vm, MODES[mode][1])
    kl_verl = verl_agg_loss(torch.exp(vref - vl) - (vref - vl) - 1, vm, MODES[mode][1], loss_scale_factor=MAX_NEW)
    assert ours.item() == pytest.approx((pg_verl + BETA * kl_verl).item(), rel=1e-6, abs=1e-7)


def test_dr_grpo_divides_by_the_maximal_response_length_not_the_row_width():
    # by hand: prompts of 2 tokens, responses of 1 and 2 tokens, at most 3 new tokens: rows of 4 positions
    per_token, mask = T([[0.0, 1.0, 0.0, 0.0], [0.0, 2.0, 3.0, 0.0]]), T([[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
    assert aggregate(per_token, mask, "dr_grpo", max_tokens=3).item() == pytest.approx(6 / (2 * 3))  # not 6 / (2 x 4)
    with pytest.raises(ValueError, match="max_tokens"):  # the old silent fallback to the row width
        aggregate(per_token, mask, "dr_grpo")
    # the fixed batch: rows of 7 target positions, responses of at most 6 tokens. Measured once, the whole
    # GRPO loss (policy + 0.04 k3): -0.063064 as TRL's, where dividing the policy term by the row width
    # gave -0.053229
    b = _batch()
    adv = _per_token_adv(b["adv"])
    (logp, mask), (old, _), (ref, _), (a, _) = (_canntrain(x) for x in (b["logp"], b["old"], b["ref"], adv))
    assert logp.shape[1] == 7 and MAX_NEW == 6
    pg, _ = clipped_policy_loss(logp, old, a, mask, CLIP_LOW, CLIP_HIGH, "dr_grpo", max_tokens=MAX_NEW)
    loss = pg + BETA * aggregate(kl_penalty(logp, ref, "k3"), mask, "dr_grpo", max_tokens=MAX_NEW)
    assert loss.item() == pytest.approx(-0.0630641, abs=1e-6)


def test_dapo_and_bnpo_over_two_data_parallel_ranks():
    """TRL dapo divides each rank's sum by num_items_in_batch / num_processes (the step's tokens over all
    ranks); bnpo by the rank's own tokens; the ranks' gradients (here: losses) are then averaged."""
    b = _batch()
    loss, mask = _completions(b["logp"])
    ranks = [(loss[:2], mask[:2]), (loss[2:], mask[2:])]  # 6 and 9 tokens
    total = mask.sum()
    dapo = sum(aggregate(x, m, "dapo", tokens=total / 2) for x, m in ranks) / 2
    assert dapo.item() == pytest.approx(((loss * mask).sum() / total).item())  # the mean over all 15 tokens
    trl = (
        sum(
            trl_grpo_loss(x, x, x, T([0.0, 0.0]), m, "dapo", beta=0, num_items_in_batch=total, num_processes=2)
            for x, m in ranks
        )
        / 2
    )
    verl = sum(verl_agg_loss(x, m, "token-mean", dp_size=2, batch_num_tokens=total) for x, m in ranks) / 2
    assert dapo.item() == pytest.approx(verl.item()) and trl.item() == pytest.approx(0.0)
    bnpo = sum(aggregate(x, m, "bnpo") for x, m in ranks) / 2
    assert bnpo.item() == pytest.approx(sum(((x * m).sum() / m.sum()).item() for x, m in ranks) / 2)
    assert bnpo.item() != pytest.approx(dapo.item())  # unequal token counts: the two differ


@pytest.mark.parametrize("estimator, verl_name", [("k1", "kl"), ("k2", "mse"), ("low_var_kl", "low_var_kl")])
def test_kl_estimators_are_verls(estimator, verl_name):
    logp = T([-1.0, -2.5, -0.1, -3.0, -0.5])
    ref = T([-1.2, -2.0, -0.1, 27.0, -40.0])  # the last two drive low_var_kl into its clamps
    assert torch.allclose(kl_penalty(logp, ref, estimator), verl_kl_penalty(logp, ref, verl_name))


def test_k3_is_trls_unclamped_estimator():
    logp, ref = T([-1.0, -2.5, -0.1, -3.0]), T([-1.2, -2.0, -0.1, 1.0])
    logr = ref - logp  # TRL PPO kl_estimator k3: (exp(logr) - 1) - logr; GRPO: exp(ref - logp) - (ref - logp) - 1
    assert torch.allclose(kl_penalty(logp, ref, "k3"), (logr.exp() - 1) - logr)
    assert kl_penalty(logp, ref, "k3")[-1].item() == pytest.approx(math.exp(4) - 5)  # 49.6: verl clamps it to 10
    assert kl_penalty(logp, ref, "low_var_kl")[-1].item() == 10
    assert torch.allclose(kl_penalty(logp, ref, "k1"), -logr)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl"])
@pytest.mark.parametrize("mode", MODES)
def test_kl_loss_with_each_estimator_and_aggregation_is_verls(estimator, mode):
    b = _batch()
    (logp, mask), (ref, _) = _canntrain(b["logp"]), _canntrain(b["ref"])
    ours = aggregate(kl_penalty(logp, ref, estimator), mask, mode, max_tokens=MAX_NEW)
    vl, vm = _completions(b["logp"], MAX_NEW)
    vref = _completions(b["ref"], MAX_NEW)[0]
    verl_name = {"k1": "kl", "k2": "mse", "k3": "k3", "low_var_kl": "low_var_kl"}[estimator]
    verl = verl_agg_loss(verl_kl_penalty(vl, vref, verl_name), vm, MODES[mode][1], loss_scale_factor=MAX_NEW)
    assert ours.item() == pytest.approx(verl.item(), rel=1e-6)  # k3 = verl's clamped k3 here: |d| < 20


def test_policy_clip_fraction_is_trls_and_verls():
    b = _batch()
    adv = _per_token_adv(b["adv"])
    (logp, mask), (old, _), (a, _) = _canntrain(b["logp"]), _canntrain(b["old"]), _canntrain(adv)
    _, frac = clipped_policy_loss(logp, old, a, mask, CLIP_LOW, CLIP_HIGH, "bnpo")
    tl, tm = _completions(b["logp"])
    assert frac.item() == pytest.approx(trl_region_clip_ratio(tl, _completions(b["old"])[0], b["adv"], tm).item())
    vl, vm = _completions(b["logp"], MAX_NEW)
    _, verl_frac, ppo_kl = verl_policy_loss(
        _completions(b["old"], MAX_NEW)[0], vl, _completions(adv, MAX_NEW)[0], vm, "token-mean"
    )
    assert frac.item() == pytest.approx(verl_frac.item())
    assert frac.item() == pytest.approx(3 / 15)  # counted once: 3 of the 15 tokens
    # actor/ppo_kl as grpo.py and ppo.py log it: the mean of old - new log-probabilities
    assert masked_mean(old - logp, mask).item() == pytest.approx(ppo_kl.item(), rel=1e-6)


def test_value_clip_fraction_counts_where_the_clipped_loss_binds():
    b = _batch()
    (v, mask), (v_old, _), (ret, _) = _canntrain(b["new_values"]), _canntrain(b["values"]), _canntrain(b["returns"])
    loss, frac = clipped_value_loss(v, v_old, ret, mask, 0.2)
    cv, cm = _completions(b["new_values"], MAX_NEW)
    ref_loss, ref_frac = verl_value_loss(
        cv, _completions(b["returns"], MAX_NEW)[0], _completions(b["values"], MAX_NEW)[0], cm, 0.2
    )
    assert loss.item() == pytest.approx(ref_loss.item()) and frac.item() == pytest.approx(ref_frac.item())
    moved = masked_mean(((v - v_old).abs() > 0.2).float(), mask)  # what was counted before: |V - V_old| > clip
    assert frac.item() == pytest.approx(4 / 15) and moved.item() == pytest.approx(13 / 15)  # counted once
    # by hand: V_old 1, V 2, clip 0.5. Return 0: V moved past the clip, but the unclipped loss (4) is the
    # larger one, so the clip does not bind; return 3: the clipped loss (2.25 > 1) binds.
    assert clipped_value_loss(T([[2.0]]), T([[1.0]]), T([[0.0]]), T([[1.0]]), 0.5)[1].item() == 0.0
    assert clipped_value_loss(T([[2.0]]), T([[1.0]]), T([[3.0]]), T([[1.0]]), 0.5)[1].item() == 1.0


def test_masked_whitening_is_unbiased_as_trls_and_verls():
    out = masked_whiten(T([1.0, 2.0, 3.0, 100.0]), T([1.0, 1.0, 1.0, 0.0]))
    assert torch.allclose(out, T([-1.0, 0.0, 1.0, 0.0]), atol=1e-6)  # sample std of 1, 2, 3 is 1
    assert masked_var(T([5.0, 7.0, 0.0]), T([1.0, 1.0, 0.0])).item() == pytest.approx(2.0)
    assert masked_var(T([5.0]), T([1.0])).item() == 0.0  # one token: no spread (TRL raises, verl divides by 0)
    b = _batch()
    x, mask = _canntrain(b["returns"])
    cx, cm = _completions(b["returns"])
    ours = masked_whiten(x, mask)[mask.bool()]
    assert torch.allclose(ours, trl_masked_whiten(cx, cm)[cm.bool()], atol=1e-6)
    assert torch.allclose(ours, verl_masked_whiten(cx, cm)[cm.bool()], atol=1e-6)


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.5)])
def test_gae_is_trls_and_verls(gamma, lam):
    b = _batch()
    scores = T([0.5, -1.0, 2.0, 0.25])
    kl = b["logp"] - b["ref"]
    flat_rewards = -0.05 * kl
    ends = torch.cumsum(T(RESPONSES), 0) - 1
    flat_rewards[ends] += scores  # the score on each response's last token
    (rewards, mask), (values, _) = _canntrain(flat_rewards), _canntrain(b["values"])
    adv, ret = gae(rewards, values, mask, gamma, lam)
    sel = mask.bool()
    v_adv, v_ret = verl_gae(rewards, values, mask, gamma, lam)  # verl on canntrain's own rows
    assert torch.allclose(adv[sel], v_adv[sel], atol=1e-6) and torch.allclose(ret[sel], v_ret[sel], atol=1e-6)
    cr, cm = _completions(flat_rewards)
    t_adv, t_ret = trl_ppo_gae(cr, _completions(b["values"])[0], gamma, lam)
    done = cm.bool()
    assert torch.allclose(adv[sel], t_adv[done], atol=1e-6) and torch.allclose(ret[sel], t_ret[done], atol=1e-6)
    assert torch.allclose(masked_whiten(adv, mask)[sel], verl_masked_whiten(v_adv, mask)[sel], atol=1e-5)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_are_trls(scale):
    rewards = T([1.0, 0.0, 0.5, 0.25, 0.9, 0.9, 0.1, 0.7])
    assert torch.allclose(group_advantages(rewards, 4, scale), trl_group_advantages(rewards, 4, scale))
    if scale != "batch":  # verl: torch.std within each group, epsilon 1e-6 (TRL and canntrain: 1e-4)
        verl = verl_grpo_advantages(rewards, [0] * 4 + [1] * 4, 1e-4, scale == "group")
        assert torch.allclose(group_advantages(rewards, 4, scale), verl)


def test_group_advantages_including_a_group_of_equal_rewards():
    adv = group_advantages(T([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5]), group_size=4)
    s = math.sqrt(1 / 3)  # sample std of 1, 0, 0, 1
    assert torch.allclose(adv[:4], T([0.5, -0.5, -0.5, 0.5]) / (s + 1e-4))
    assert torch.equal(adv[4:], torch.zeros(4))  # all equal: nothing to learn from this prompt


def test_kl_estimator_is_read_by_ppo_and_grpo_only():
    from canntrain_core.errors import RecipeError
    from canntrain_core.recipe import load_recipe

    base = {"model.init_from": "x", "data.source": "p.jsonl"}
    assert (
        load_recipe(None, {**base, "train_mode": "ppo", "rlhf.kl_estimator": "low_var_kl"}).rlhf.kl_estimator
        == "low_var_kl"
    )
    assert load_recipe(None, {**base, "train_mode": "grpo"}).rlhf.kl_estimator is None  # the stage's default
    with pytest.raises(RecipeError, match="does not read"):
        load_recipe(None, {**base, "train_mode": "dpo", "rlhf.kl_estimator": "k1"})


# ---------------------------------------------------------------- by hand
def test_gae_and_returns_by_hand():
    # gamma 1, lam 0.95; delta_2 = 1 - 0.3, delta_1 = 0.3 - 0.4, delta_0 = 0.4 - 0.5
    adv, ret = gae(T([[0.0, 0.0, 1.0]]), T([[0.5, 0.4, 0.3]]), T([[1.0, 1.0, 1.0]]), 1.0, 0.95)
    assert torch.allclose(adv, T([[-0.1 + 0.95 * (-0.1 + 0.95 * 0.7), -0.1 + 0.95 * 0.7, 0.7]]))
    assert torch.allclose(ret, T([[0.93675, 0.965, 1.0]]))
    # the last token is padding: it has no value, no advantage, and the reward sits on token 1
    adv, _ = gae(T([[0.0, 1.0, 0.0]]), T([[0.5, 0.4, 9.0]]), T([[1.0, 1.0, 0.0]]), 0.9, 0.5)
    assert torch.allclose(adv, T([[(0.9 * 0.4 - 0.5) + 0.9 * 0.5 * 0.6, 1.0 - 0.4, 0.0]]))


@pytest.mark.parametrize(
    "adv, ratio, want, binds",
    [
        (1.0, 1.5, -1.2, True),  # gain capped at 1 + eps
        (-1.0, 1.5, 1.5, False),  # a loss is never capped from below
        (1.0, 0.5, -0.5, False),
        (-1.0, 0.5, 0.8, True),  # the ratio may not fall below 1 - eps on a negative advantage
        (1.0, 1.1, -1.1, False),  # inside the clip range
    ],
)
def test_clipped_policy_loss_on_each_side(adv, ratio, want, binds):
    loss, frac = clipped_policy_loss(T([[math.log(ratio)]]), T([[0.0]]), T([[adv]]), T([[1.0]]), 0.2)
    assert loss.item() == pytest.approx(want) and frac.item() == float(binds)


def test_asymmetric_clip_range_dapo():
    loss, _ = clipped_policy_loss(T([[math.log(1.5)]]), T([[0.0]]), T([[1.0]]), T([[1.0]]), 0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-1.28)


@pytest.mark.parametrize("v, want, binds", [(2.0, 2.0, False), (0.2, 0.125, True), (1.2, 0.72, False)])
def test_clipped_value_loss(v, want, binds):
    # old value 1, return 0, clip 0.5: 0.5 max((v - 0)^2, (clip(v, 0.5, 1.5) - 0)^2)
    loss, frac = clipped_value_loss(T([[v]]), T([[1.0]]), T([[0.0]]), T([[1.0]]), 0.5)
    assert loss.item() == pytest.approx(want) and frac.item() == float(binds)


def test_kl_is_zero_when_the_policy_is_the_reference():
    logp = T([[-1.0, -2.5, -0.1]])
    for kind in ("k1", "k2", "k3", "low_var_kl"):
        assert torch.equal(kl_penalty(logp, logp, kind), torch.zeros(1, 3))
    assert kl_penalty(T([[-1.0]]), T([[-2.0]]), "k3").item() == pytest.approx(math.exp(-1) + 1 - 1)
    assert kl_penalty(T([[-1.0]]), T([[-2.0]]), "k2").item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="k1, k2, k3, low_var_kl"):
        kl_penalty(logp, logp, "k4")


def test_dpo_loss_closed_form():
    loss, margin = dpo_loss(T([-1.0]), T([-2.0]), T([-1.5]), T([-1.5]), beta=0.1)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-0.1)))  # h = 0.5 - (-0.5) = 1
    assert margin.item() == pytest.approx(0.1)
    smoothed, _ = dpo_loss(T([-1.0]), T([-2.0]), T([-1.5]), T([-1.5]), beta=0.1, label_smoothing=0.1)
    assert smoothed.item() == pytest.approx(0.9 * math.log(1 + math.exp(-0.1)) + 0.1 * math.log(1 + math.exp(0.1)))


def test_loss_aggregations_by_hand():
    per_token, mask = T([[1.0, 1.0, 0.0], [4.0, 0.0, 0.0]]), T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate(per_token, mask, "grpo").item() == pytest.approx((1 + 4) / 2)  # per response, then mean
    assert aggregate(per_token, mask, "bnpo").item() == pytest.approx(6 / 3)  # per token
    assert aggregate(per_token, mask, "dapo").item() == pytest.approx(6 / 3)  # one rank: bnpo
    assert aggregate(per_token, mask, "dapo", tokens=4.0).item() == pytest.approx(6 / 4)  # the step's tokens / ranks
    assert aggregate(per_token, mask, "dr_grpo", max_tokens=5).item() == pytest.approx(6 / (2 * 5))  # / (B x max)


def test_pairwise_reward_loss():
    assert pairwise_reward_loss(T([2.0]), T([0.0])).item() == pytest.approx(math.log(1 + math.exp(-2)))
