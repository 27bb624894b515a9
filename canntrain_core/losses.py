"""The arithmetic of alignment, as small pure functions on [batch, response tokens] tensors.

Every tensor is laid out per response token; ``mask`` is 1 on tokens the policy generated (0 on the
prompt and on padding after the end token). Each function equals its namesake in TRL and verl on the
same tensors (``tests/losses/test_rlhf_math.py`` re-derives theirs and compares): TRL's ``GRPOTrainer._compute_loss``
(``loss_type``), ``PPOTrainer`` and ``utils.masked_whiten``; verl's ``trainer/ppo/core_algos.py``
(``agg_loss``, ``kl_penalty``, ``compute_value_loss``, ``compute_gae_advantage_return``). Where the two
peers differ, the docstring says which one a mode follows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The unbiased variance over the masked tokens (Bessel's n / (n - 1)), as TRL's and verl's ``masked_var``
    (``unbiased=True``); one token: 0."""
    mean = masked_mean(x, mask)
    n = mask.sum()
    return masked_mean((x - mean) ** 2, mask) * n / (n - 1).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked tokens, with the unbiased variance (TRL's and verl's
    ``masked_whiten``); ``shift_mean=False`` keeps the mean. Padding comes out 0 (TRL fills it with 0 too)."""
    mean = masked_mean(x, mask)
    out = (x - mean) * torch.rsqrt(masked_var(x, mask) + 1e-8)
    return (out if shift_mean else out + mean) * mask


KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probabilities
    (Schulman's estimators, http://joschu.net/blog/kl-approx.html; d = ref_logp - logp):

    ``k1``: -d (unbiased, can be negative: TRL's PPO default and verl's ``kl``);
    ``k2``: d^2 / 2 (biased, never negative: verl's ``mse``/``k2``);
    ``k3``: exp(d) - d - 1 (unbiased, never negative: TRL's GRPO term and its PPO ``kl_estimator: k3``);
    ``low_var_kl``: k3 with d clamped to [-20, 20] and the result to [-10, 10] (verl's ``low_var_kl``,
    which verl also calls ``k3``).
    """
    d = ref_logp - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        return torch.exp(d) - d - 1
    if kind == "low_var_kl":
        d = d.clamp(-20, 20)
        return (torch.exp(d) - d - 1).clamp(-10, 10)
    raise ValueError(f"KL estimator {kind!r}: expected one of {', '.join(KL_ESTIMATORS)}")


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each response; returns (advantages, returns).

    delta_t = r_t + gamma V_{t+1} - V_t with V = 0 after the last generated token;
    A_t = delta_t + gamma lam A_{t+1}; returns = A + V. On generated tokens: verl's mask-aware
    ``compute_gae_advantage_return``, and TRL ``PPOTrainer``'s loop over completions whose values are 0
    past the response (TRL keeps the critic's value one position past the end and puts the score there).
    """
    T = rewards.shape[-1]
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[..., 0])
    values = values * mask
    for t in reversed(range(T)):
        next_value = values[..., t + 1] if t + 1 < T else torch.zeros_like(last)
        delta = rewards[..., t] + gamma * next_value - values[..., t]
        last = (delta + gamma * lam * last) * mask[..., t]
        advantages[..., t] = last
    return advantages, advantages + values


def clipped_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float | None = None,
    aggregation: str = "token",
    max_tokens: int | None = None,
    tokens: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate: max(-A r, -A clip(r, 1 - low, 1 + high)); returns (loss, clip fraction).

    The clip fraction is the share of generated tokens where the clipped term is the larger (verl's
    ``actor/pg_clipfrac``; the same tokens as TRL's GRPO ``clip_ratio/region_mean``, r outside the range
    on the side the advantage pushes, and its PPO ``policy/clipfrac_avg``). ``aggregation``,
    ``max_tokens`` and ``tokens``: see :func:`aggregate`. verl's dual clip (``clip_ratio_c``, which caps
    -A r at -3A when A < 0) is not applied.
    """
    clip_high = clip_low if clip_high is None else clip_high
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    clip_frac = masked_mean((clipped > unclipped).float(), mask)
    return aggregate(per_token, mask, aggregation, max_tokens, tokens), clip_frac


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 max((V - R)^2, (clip(V, V_old +- clip) - R)^2), the mean over generated tokens; returns
    (loss, clip fraction): the share of tokens where the clipped term is the larger, i.e. where the clip
    binds (verl's ``critic/vf_clipfrac``, TRL's ``val/clipfrac_avg``), not where |V - V_old| > clip."""
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    unclipped, clipped = (values - returns) ** 2, (v_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask)
    return loss, masked_mean((clipped > unclipped).float(), mask)


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    max_tokens: int | None = None,
    tokens: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """One loss from the per-token losses [B, T] of one optimizer step's mini-batch (on this rank):

    ``grpo``: the mean over each response's tokens, then over responses (DeepSeekMath's GRPO; TRL
    ``loss_type="grpo"``, verl ``seq-mean-token-mean``);
    ``bnpo`` (and PPO's ``token``): the mean over this mini-batch's generated tokens (TRL ``bnpo`` and
    ``PPOTrainer``'s ``masked_mean``; verl's ``token-mean`` up to 0.4, before it counted tokens globally);
    ``dapo``: the sum over tokens / ``tokens``, the generated tokens of the whole step's batch over all
    data-parallel ranks divided by their number (TRL ``dapo``: ``num_items_in_batch / num_processes``;
    verl's ``token-mean`` with its global ``batch_num_tokens``): once the ranks' gradients are averaged,
    the mean over every token of the step. ``tokens`` None: this rank's own count (= ``bnpo``);
    ``dr_grpo``: the sum over tokens / (responses x ``max_tokens``, the longest response the rollout may
    generate: ``rlhf.generate_max_length``), Dr. GRPO's length-unbiased loss (TRL ``dr_grpo``:
    ``max_completion_length``; verl ``seq-mean-token-sum-norm`` with ``loss_scale_factor`` = the
    maximal response length). Not the padded width of the rows, which holds the prompt too.
    """
    if mode == "grpo":
        return masked_mean(per_token, mask, dim=-1).mean()
    if mode in ("bnpo", "token"):
        return masked_mean(per_token, mask)
    if mode == "dapo":
        count = mask.sum() if tokens is None else tokens
        return (per_token * mask).sum() / (count.clamp(min=1) if torch.is_tensor(count) else max(count, 1))
    if mode == "dr_grpo":
        if not max_tokens:
            raise ValueError(
                "loss aggregation dr_grpo divides by the maximal response length: pass max_tokens "
                "(rlhf.generate_max_length)"
            )
        return (per_token * mask).sum() / (per_token.shape[0] * max_tokens)
    raise ValueError(f"loss aggregation {mode!r}: expected grpo, bnpo, dr_grpo or dapo")


def group_advantages(scores: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """GRPO: each answer's score minus its group's mean (over the ``group_size`` answers to one prompt),
    divided by the standard deviation (+1e-4) of the group's scores (``scale="group"``), of all the scores
    (``"batch"``) or by nothing (``"none"``, Dr. GRPO); a group of equal scores gives 0."""
    g = scores.view(-1, group_size)
    adv = g - g.mean(dim=1, keepdim=True)
    if scale == "group":
        adv = adv / (g.std(dim=1, keepdim=True) + 1e-4)
    elif scale == "batch":
        adv = adv / (scores.std() + 1e-4)
    elif scale != "none":
        raise ValueError(f"scale_rewards {scale!r}: expected group, batch or none")
    return adv.view(-1)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO's sigmoid loss on sequence log-probabilities; returns (per-pair loss, implicit reward margin).

    -log sigmoid(beta h) (1 - eps) - log sigmoid(-beta h) eps, h = (pi_c - ref_c) - (pi_r - ref_r).
    """
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    loss = -F.logsigmoid(beta * h) * (1 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    return loss, beta * h


def pairwise_reward_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """The reward model's loss: -log sigmoid(r_chosen - r_rejected), per pair."""
    return -F.logsigmoid(r_chosen - r_rejected)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy of the categorical distribution the logits define."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
