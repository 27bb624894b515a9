"""The arithmetic of alignment, as small pure functions on [batch, response tokens] tensors.

Every tensor is laid out per response token; ``mask`` is 1 on tokens the policy generated (0 on
padding after the end token). Names follow TRL and verl where they have one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / std over the masked tokens (population variance); ``shift_mean=False`` keeps the mean."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    return (out if shift_mean else out + mean) * mask


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens' log-probabilities.

    ``k1``: logp - ref_logp (unbiased, can be negative); ``k3``: exp(ref - logp) - (ref - logp) - 1
    (unbiased, never negative, lower variance: GRPO's choice).
    """
    d = ref_logp - logp
    if kind == "k1":
        return -d
    if kind == "k3":
        return torch.exp(d) - d - 1
    raise ValueError(f"KL estimator {kind!r}: expected k1 or k3")


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each response; returns (advantages, returns).

    delta_t = r_t + gamma V_{t+1} - V_t with V = 0 after the last generated token;
    A_t = delta_t + gamma lam A_{t+1}; returns = A + V.
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


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                        clip_low: float, clip_high: float | None = None, aggregation: str = "token"
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate: max(-A r, -A clip(r, 1 - low, 1 + high)); returns (loss, clip fraction).

    ``aggregation`` (see :func:`aggregate`) says how per-token losses become one number.
    """
    clip_high = clip_low if clip_high is None else clip_high
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    clip_frac = masked_mean((clipped > unclipped).float(), mask)
    return aggregate(per_token, mask, aggregation), clip_frac


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       clip: float) -> torch.Tensor:
    """0.5 max((V - R)^2, (clip(V, V_old +- clip) - R)^2), the mean over generated tokens."""
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * masked_mean(torch.maximum((values - returns) ** 2, (v_clipped - returns) ** 2), mask)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, max_tokens: int | None = None) -> torch.Tensor:
    """One loss from per-token losses [B, T].

    ``grpo``: mean over each response's tokens, then over responses (DeepSeekMath's GRPO);
    ``bnpo``/``token``/``dapo``: mean over all generated tokens of the batch (DAPO's token-level loss);
    ``dr_grpo``: sum over tokens / (responses x the maximal response length) (Dr. GRPO: no length bias).
    """
    if mode == "grpo":
        return masked_mean(per_token, mask, dim=-1).mean()
    if mode in ("bnpo", "token", "dapo"):
        return masked_mean(per_token, mask)
    if mode == "dr_grpo":
        return (per_token * mask).sum() / (per_token.shape[0] * (max_tokens or per_token.shape[-1]))
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


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, label_smoothing: float = 0.0
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
