"""Exact match on held-out instructions: generate each final answer greedily, compare with the reference.

Every rank of a job runs the same examples in the same order (same prompts, same argmax), so the
forward passes line up for FSDP2 and TP collectives; pipeline layouts are not scored.
"""

from __future__ import annotations

from canntrain_core.finetune.tasks import score
from canntrain_core.models.generate import greedy


def exact_match(model, examples: list[tuple[list[int], str]], decode, eos_id: int, max_new_tokens: int = 16
                ) -> tuple[float, list[tuple[str, str]]]:
    """Share of ``examples`` (prompt ids, expected answer) answered exactly; and (answer, expected) pairs."""
    pairs = []
    for prompt, expected in examples:
        out = greedy(model, prompt, max_new_tokens, eos_id)
        answer = decode(out[:-1] if out and out[-1] == eos_id else out)
        pairs.append((answer, expected))
    hits = sum(score(a, e) for a, e in pairs)
    return hits / max(1, len(pairs)), pairs
