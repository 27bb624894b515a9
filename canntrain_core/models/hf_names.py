"""Where each of canntrain's tensors lives in a family's Hugging Face files, when they are not the same tensors:
``Family.hf_names`` (``families/family.py``) as pieces, boxes of one tensor matched to boxes of the other.

GPT-2: canntrain's q, k and v projections are three column blocks of the files' ``c_attn``, transposed.
Mixtral: canntrain's (transformers' in-memory) ``experts.gate_up_proj`` [experts, 2 x inter, hidden] stacks the
files' per-expert ``w1`` (gate) and ``w3`` (up); ``experts.down_proj`` stacks their ``w2``.

A rank reads, for its shard of a tensor, only the parts of the files' tensors it covers; export assembles
each of the files' tensors from its pieces.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from canntrain_core.families import family_of

Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension


@dataclass(frozen=True)
class Piece:
    theirs: str  # the files' tensor
    box: Box  # the part of canntrain's tensor it fills
    their_box: Box  # the part of the files' tensor, in its own dimensions
    transposed: bool = False  # stored transposed (GPT-2's Conv1D)
    squeeze: bool = False  # canntrain's leading index is fixed (one expert): the files' tensor lacks that dimension

    def their_slices(self, sub: Box) -> tuple[slice, ...]:
        """The files' slices that hold ``sub``, a box inside ``box``."""
        rel = [(s - b, e - b) for (s, e), (b, _) in zip(sub, self.box)]
        rel = rel[1:] if self.squeeze else rel
        rel = rel[::-1] if self.transposed else rel
        return tuple(slice(t + s, t + e) for (s, e), (t, _) in zip(rel, self.their_box))

    def as_ours(self, theirs: torch.Tensor) -> torch.Tensor:
        """A block of the files' tensor laid out as canntrain's."""
        out = theirs.T if self.transposed else theirs
        return out.unsqueeze(0) if self.squeeze else out

    def as_theirs(self, ours: torch.Tensor) -> torch.Tensor:
        out = ours.squeeze(0) if self.squeeze else ours
        return out.T if self.transposed else out


def pieces(config, name: str, shape) -> list[Piece]:
    """Where canntrain's tensor ``name`` (its Hugging Face-style name) of ``shape`` lives in the family's files."""
    shape = list(shape)
    full = tuple((0, n) for n in shape)
    found = []
    for rule in family_of(config).hf_names:
        m = re.fullmatch(rule.ours, name)
        if not m:
            continue
        if rule.experts:  # ours[e] holds part `part` of its dim 1 from the files' tensor of expert e
            rows = shape[1] // rule.parts
            for e in range(shape[0]):
                box = ((e, e + 1), (rule.part * rows, (rule.part + 1) * rows), *full[2:])
                their = ((0, rows), *full[2:])
                found.append(Piece(rule.theirs.format(*m.groups(), e=e), box, their, rule.transposed, squeeze=True))
        else:  # ours is part `part` of the files' tensor's last dimension
            their = list(full[::-1] if rule.transposed else full)
            size = their[-1][1]
            their[-1] = (rule.part * size, (rule.part + 1) * size)
            found.append(Piece(rule.theirs.format(*m.groups()), full, tuple(their), rule.transposed))
    return found or [Piece(name, full, full)]


def their_shapes(config, shapes: dict[str, torch.Size]) -> dict[str, torch.Size]:
    """The files' tensors that canntrain's ``shapes`` fill, with their shapes."""
    extent: dict[str, list[int]] = {}
    for name, shape in shapes.items():
        for p in pieces(config, name, shape):
            top = extent.setdefault(p.theirs, [0] * len(p.their_box))
            extent[p.theirs] = [max(t, stop) for t, (_, stop) in zip(top, p.their_box)]
    return {n: torch.Size(s) for n, s in extent.items()}


def to_hf_layout(config, shapes: dict[str, torch.Size], load):
    """canntrain's tensors (``shapes`` by name, ``load(names)`` -> whole tensors) as the family's files hold
    them: (files' name -> shape, ``load(files' names)`` -> whole tensors). Identity for transformers' trees."""
    if not family_of(config).hf_names:
        return shapes, load
    sources: dict[str, list[tuple[str, Piece]]] = {}
    for name, shape in shapes.items():
        for p in pieces(config, name, shape):
            sources.setdefault(p.theirs, []).append((name, p))
    hf_shapes = their_shapes(config, shapes)

    def hf_load(names: list[str]) -> dict[str, torch.Tensor]:
        ours = load(sorted({n for t in names for n, _ in sources[t]}))
        out = {}
        for t in names:
            first = ours[sources[t][0][0]]
            out[t] = torch.empty(hf_shapes[t], dtype=first.dtype)
            for n, p in sources[t]:
                out[t][p.their_slices(p.box)] = p.as_theirs(ours[n][tuple(slice(s, e) for s, e in p.box)])
        return out

    return hf_shapes, hf_load
