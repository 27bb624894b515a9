"""Exact match on held-out instructions: generate each final answer greedily, compare with the reference.

Every rank of a job runs the same examples in the same order (same prompts, same argmax), so the
forward passes line up for FSDP2 and TP collectives; pipeline layouts are not scored.
"""

from __future__ import annotations

from canntrain_core.finetune.tasks import score
from canntrain_core.models.generate import greedy
from canntrain_core.models.rollout import sample

BATCH = 64  # prompts decoded together


def exact_match(
    model,
    examples: list[tuple[list[int], str]],
    decode,
    eos_id: int,
    max_new_tokens: int = 16,
    cached: bool = True,
    multiple_of: int = 1,
) -> tuple[float, list[tuple[str, str]]]:
    """Share of ``examples`` (prompt ids, expected answer) answered exactly; and (answer, expected) pairs.

    ``cached``: batches of left-padded prompts decoded with a KV cache (``models.rollout.sample``), which
    a 7B model needs; False re-runs each whole sequence per token, one prompt at a time (``greedy``, the
    sequence right-padded to a ``multiple_of`` the TP degree): the path for sequence parallelism, which
    cannot split a one-token decode step over its ranks.
    """
    prompts = [p for p, _ in examples]
    if cached:  # sample(): eval mode, each response cut after its first end token
        outs = [
            r
            for i in range(0, len(prompts), BATCH)
            for r in sample(model, prompts[i : i + BATCH], 1, max_new_tokens, eos_id, temperature=0.0).responses
        ]
    else:
        outs = [greedy(model, p, max_new_tokens, eos_id, multiple_of) for p in prompts]
    pairs = [(decode(o[:-1] if o and o[-1] == eos_id else o), expected) for o, (_, expected) in zip(outs, examples)]
    hits = sum(score(a, e) for a, e in pairs)
    return hits / max(1, len(pairs)), pairs
