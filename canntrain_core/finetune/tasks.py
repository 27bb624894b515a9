"""Instruction tasks with answers a program can check, small enough for a tiny model on a CPU.

Each item is space-separated so every character is its own token whatever the tokenizer:

- reverse: ``Reverse the letters: c a t s``  -> ``s t a c``
- sort:    ``Sort the digits: 4 1 3``        -> ``1 3 4``
- add:     ``Add: 23 + 9``                   -> ``3 2``   (digits spaced as well)
- upper:   ``Uppercase: a b c``              -> ``A B C``

:func:`task_records` writes alpaca-style records; :func:`score` is the programmatic check (exact
match after stripping); :func:`partial_score` its graded form, the alignment recipes' true reward.
"""

from __future__ import annotations

import random
import string

KINDS = ("reverse", "sort", "add", "upper")


def make_item(kind: str, rng: random.Random) -> tuple[str, str]:
    """(instruction, answer) of one random item."""
    n = rng.randint(3, 5)
    if kind == "reverse":
        letters = [rng.choice(string.ascii_lowercase) for _ in range(n)]
        return f"Reverse the letters: {' '.join(letters)}", " ".join(reversed(letters))
    if kind == "sort":
        digits = [rng.choice(string.digits) for _ in range(n)]
        return f"Sort the digits: {' '.join(digits)}", " ".join(sorted(digits))
    if kind == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return f"Add: {a} + {b}", " ".join(str(a + b))
    if kind == "upper":
        letters = [rng.choice(string.ascii_lowercase) for _ in range(n)]
        return f"Uppercase: {' '.join(letters)}", " ".join(c.upper() for c in letters)
    raise ValueError(f"unknown task {kind!r}; known: {', '.join(KINDS)}")


def task_records(n: int, seed: int = 0, kinds: tuple[str, ...] = KINDS) -> list[dict]:
    """``n`` alpaca records, the kinds in turn; the same seed gives the same records."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        instruction, answer = make_item(kinds[i % len(kinds)], rng)
        out.append({"instruction": instruction, "output": answer})
    return out


def score(answer: str, expected: str) -> float:
    """1.0 for an exact match (surrounding whitespace aside), else 0.0."""
    return float(answer.strip() == expected.strip())


def partial_score(answer: str, expected: str) -> float:
    """The share of the expected space-separated items the answer has in place, over the longer of the
    two (so extra items cost too): 1.0 exactly when :func:`score` is 1. The alignment recipes' true
    reward: denser than exact match, so a policy gets a signal before it is fully right."""
    got, want = answer.split(), expected.split()
    if not got and not want:
        return 1.0
    return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want))
