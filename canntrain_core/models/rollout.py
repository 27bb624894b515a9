"""Sampling responses and scoring their tokens: the one KV-cached generation loop. Online alignment's rollouts
start with it; exact match (``finetune/evaluate.py``) and ``canntrain generate`` decode with it too.

Generation decodes with a KV cache (transformers' ``DynamicCache``): the prompts are left-padded into
one batch, read once (prefill), then each step feeds only the newest token. It always runs
``rlhf.generate_max_length`` steps and cuts each response after its first end token, so every rank of a
data-parallel job makes the same forward passes in the same order (FSDP2 and TP collectives line up).
The log-probabilities the losses use are then recomputed by a plain forward pass over the right-padded
rows (:func:`token_logprobs`), as verl recomputes ``old_log_prob``: the update compares like with like.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import DynamicCache


@dataclass
class Rollout:
    """N sampled responses laid out for the losses: ``ids`` [N, L] (prompt, response, padding) and, per
    target position t (predicting ids[t + 1]), ``mask`` [N, L - 1] = 1 on response tokens."""

    ids: torch.Tensor
    mask: torch.Tensor
    prompt_lens: list[int]
    responses: list[list[int]]  # response tokens, the end token included when one was generated
    ended: torch.Tensor  # [N] bool: the response has an end token
    # a rollout engine's sample (engines/): its log p of each response token, laid out as ``mask``, and the step of
    # the weights that drew it; None when sampled in this process
    logprobs: torch.Tensor | None = None
    version: int | None = None

    @property
    def last(self) -> torch.Tensor:
        """[N] the target position of each response's last token (where a sequence reward lands)."""
        return (self.mask * torch.arange(self.mask.shape[1])).argmax(-1)


def _pick(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, top_k).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1)


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    max_new: int,
    pad_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    stop_ids: tuple[int, ...] = (),
) -> list[list[int]]:
    """``max_new`` new tokens for each prompt (``temperature`` 0: greedy), decoded with a KV cache.

    ``stop_ids``: end tokens; once every row has generated one, decoding stops (rows may then be shorter
    than ``max_new``). In a job of several ranks (the default process group: the trained model's ranks) they
    must make the same forward passes, so they stop together: when every rank's rows have ended (one
    all-reduce of a flag per step).

    The prompts are left-padded; a padded position is masked out of every query's keys and the
    positions count only real tokens, so each row computes what it would alone (to float rounding).
    """
    device = next(model.parameters()).device
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long, device=device)
    real = torch.zeros((len(prompts), P), dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = torch.tensor(p, device=device)
        real[i, P - len(p) :] = True
    positions = (real.cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones((P, P), dtype=torch.bool, device=device).tril()
    # a padded query attends to itself only: no row of the mask is empty (an empty row gives NaN)
    mask = (causal & real[:, None, :]) | torch.eye(P, dtype=torch.bool, device=device)
    # every key kept: CausalLM's masks apply a sliding window themselves (transformers' sliding cache layers, which a
    # config would choose, drop keys those masks count)
    cache = DynamicCache()
    logits = model(ids, position_ids=positions, attention_mask=mask[:, None], cache=cache)[:, -1].float()
    out = []
    stop = torch.tensor(list(stop_ids), device=device) if stop_ids else None
    ended = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    for step in range(max_new):
        nxt = _pick(logits, temperature, top_k)
        out.append(nxt)
        if stop is not None:
            ended |= torch.isin(nxt[:, 0], stop)
        if step == max_new - 1 or (stop is not None and _all_ended(ended)):
            break
        real = torch.cat([real, torch.ones_like(nxt, dtype=torch.bool)], dim=1)
        positions = positions[:, -1:] + 1
        logits = model(nxt, position_ids=positions, attention_mask=real[:, None, None, :], cache=cache)[:, -1].float()
    return torch.cat(out, dim=1).tolist()


def _all_ended(ended: torch.Tensor) -> bool:
    """Whether every row of every rank (the default process group) has ended."""
    done = ended.all().to(torch.int32)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
    return bool(done)


@torch.no_grad()
def sample(
    model,
    prompts: list[list[int]],
    n: int,
    max_new: int,
    eos_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    pad_id: int | None = None,
) -> Rollout:
    """``n`` responses to each prompt (``temperature`` 0: greedy), each cut after its first end token."""
    was_training = model.training
    model.eval()
    pad = pad_id if pad_id is not None else eos_id
    expanded = [p for p in prompts for _ in range(n)]
    responses = [
        row[: row.index(eos_id) + 1] if eos_id in row else row
        for row in generate(model, expanded, max_new, pad, temperature, top_k, stop_ids=(eos_id,))
    ]
    model.train(was_training)
    return layout(expanded, responses, eos_id, pad)


def layout(prompts: list[list[int]], responses: list[list[int]], eos_id: int, pad_id: int) -> Rollout:
    """Right-padded prompt + response rows and the response-token mask of the shifted targets."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L - 1))
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        mask[i, len(p) - 1 : len(p) - 1 + len(r)] = 1.0  # target t predicts ids[t + 1]
    ended = torch.tensor([bool(r) and r[-1] == eos_id for r in responses])
    return Rollout(ids, mask, [len(p) for p in prompts], responses, ended)


def token_logprobs(model, ids: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False):
    """log p(ids[t + 1] | ids[:t + 1]) for every position t: [N, L - 1] (and the entropies), of the
    distribution the rollout sampled from (logits / ``temperature``; 0 counts as 1)."""
    logits = model(ids[:, :-1]).float()
    if temperature and temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return picked
    return picked, -(logp.exp() * logp).sum(-1)


def token_values(model, ids: torch.Tensor) -> torch.Tensor:
    """A scalar-head model's output at every position t (the value of the state ids[:t + 1]): [N, L - 1]."""
    return model(ids[:, :-1])[..., 0].float()
