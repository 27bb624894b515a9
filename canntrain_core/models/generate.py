"""Sampling text from a trained model, to see what the loss number means; greedy decoding without a cache
(the one path for sequence parallelism, which cannot split a one-token step over its ranks)."""

from __future__ import annotations

import torch

from canntrain_core.models.rollout import generate


@torch.no_grad()
def sample_text(
    model,
    data,
    prompt: str = "def ",
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
) -> str:
    """Continue ``prompt`` with top-k sampling: the rollouts' KV-cached loop (``models.rollout.generate``),
    stopping at the end-of-text token.

    ``model`` is a CausalLM; ``data`` is the DataBundle whose tokenizer trained it.
    """
    prompt_ids = data.encode(prompt)
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = generate(model, [prompt_ids], max_new_tokens, data.eos_id, temperature, top_k, stop_ids=(data.eos_id,))
    model.train(was_training)
    new = out[0][: out[0].index(data.eos_id) + 1] if data.eos_id in out[0] else out[0]
    return data.decode(prompt_ids + new)


@torch.no_grad()
def greedy(
    model, prompt_ids: list[int], max_new_tokens: int, eos_id: int | None = None, multiple_of: int = 1
) -> list[int]:
    """The most likely continuation of ``prompt_ids``, one argmax token at a time, stopping at EOS.

    ``model`` maps token ids [1, T] to logits [1, T, V] (a CausalLM, or a wrapper around a transformers
    model's ``.logits``). No KV cache: the whole sequence is re-run per token. ``multiple_of``: the
    sequence is right-padded to a multiple of it (sequence parallelism splits it evenly over the TP
    ranks); causal attention keeps the padding out of every real position's logits.
    """
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    was_training = model.training
    model.eval()
    out: list[int] = []
    for _ in range(max_new_tokens):
        n = ids.shape[1]
        padded = torch.nn.functional.pad(ids, (0, -n % multiple_of), value=int(ids[0, -1]))
        nxt = int(model(padded)[0, n - 1].argmax())
        out.append(nxt)
        if nxt == eos_id:
            break
        ids = torch.cat([ids, torch.tensor([[nxt]], device=device)], dim=1)
    model.train(was_training)
    return out
