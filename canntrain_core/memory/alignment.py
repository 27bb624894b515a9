"""Memory of an alignment run: which models are resident where, and the peak per rank.

PPO holds four models: the actor and the critic train (parameters, gradients, AdamW states, activations:
:func:`~canntrain_core.sizing.estimator.estimate` of each, the critic with a one-row head), the reference
and the reward model only run forward (parameters, and the logits of scoring a rollout). GRPO holds the
actor and, when ``rlhf.kl_coeff`` > 0, the reference; DPO the policy and the reference; the reward model
stage one scalar-head model. A rank's peak is the largest of three phases:

- rollout: every resident model's states + the KV cache of ``data.batch_size`` x group responses of
  ``data.seq_length`` tokens (K and V per layer, in the compute precision);
- experience: the states + the fp32 logits and log-softmax of scoring the rollout ([N, L, V] twice);
- update: the trained models' training estimate at the same phase, summed (the loss is one sum, so their
  activations coexist), + the frozen models' parameters, for a mini-batch of ``rlhf.mini_batch_size``.

Placement (``rlhf.device_placement``): ``shared`` keeps the frozen models in the trainer's processes,
sharded like the actor; ``separated`` gives them ``rlhf.scorer_ranks`` processes of their own, each holding
whole copies. Either way a frozen model is stored in the recipe's precision (2 bytes a parameter under bf16 or
fp16: ``models.lifecycle.hold_frozen_in_16_bits``), the trained ones in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from canntrain_core.memory.measure import local_bytes
from canntrain_core.memory.recipe_shape import shape_from_recipe
from canntrain_core.runtime.accelerator import DTYPES
from canntrain_core.sizing.estimator import GiB, estimate
from canntrain_core.sizing.setup import setup_from_recipe
from canntrain_core.stages import stage_of
from canntrain_core.train.trainer import Trainer


@dataclass
class Role:
    name: str
    trains: bool
    rank: str  # "trained ranks" or "scorer ranks"
    states: int  # resident bytes per rank: parameters (+ gradients + optimizer states when it trains)


@dataclass
class AlignmentEstimate:
    mode: str  # the stage's train_mode
    placement: str
    roles: list[Role]
    phases: dict[str, int]  # peak bytes per phase on a trained rank
    scorer_rank: int = 0  # peak bytes on a scorer rank (separated placement)
    kv_cache: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def trained_rank(self) -> int:
        return max(self.phases.values())

    def table(self) -> str:
        lines = [f"{'model':10s} {'trains':>6s} {'where':>14s} {'resident GiB':>13s}"]
        lines += [
            f"{r.name:10s} {'yes' if r.trains else 'no':>6s} {r.rank:>14s} {r.states / GiB:13.3f}" for r in self.roles
        ]
        lines.append(f"KV cache of a rollout: {self.kv_cache / GiB:.3f} GiB")
        lines += [f"peak on a trained rank, {p}: {b / GiB:.3f} GiB" for p, b in self.phases.items()]
        if self.scorer_rank:
            lines.append(f"peak on a scorer rank: {self.scorer_rank / GiB:.3f} GiB")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def several_models(recipe) -> bool:
    """Whether a rank of ``recipe``'s stage holds more than one plain language model (the alignment stages:
    frozen references, reward models, scalar heads), which :func:`estimate_alignment` estimates."""
    return stage_of(recipe).roles(recipe) != Trainer.roles(recipe)


def estimate_alignment(recipe) -> AlignmentEstimate:
    """Per-rank memory of ``recipe`` (its stage's models, :meth:`Trainer.roles`) by model and phase."""
    h, d, stage = recipe.rlhf, recipe.distributed, stage_of(recipe)
    shape = shape_from_recipe(recipe)
    mini, n_rollout = stage.rows(recipe)  # rows per optimizer step and per rollout, on one rank
    online = n_rollout > 0
    setup = setup_from_recipe(recipe, micro_batch=mini, grad_accum=1)
    separated = stage.extra_ranks(recipe) > 0
    shard = d.tensor_parallel_size * (d.data_parallel_size if d.zero_optimization >= 1 else 1)
    half = DTYPES[recipe.model.precision].itemsize  # bytes of a frozen weight, and of a KV cache entry
    roles, trained = [], []
    frozen_here = frozen_there = 0
    for name, trains, scalar in stage.roles(recipe):
        sh = shape.as_scalar_head() if scalar else shape
        if trains:
            est = estimate(sh, setup)
            trained.append(est)
            roles.append(Role(name, True, "trained ranks", est.model_states))
        elif separated:
            b = half * sh.num_params()
            frozen_there += b
            roles.append(Role(name, False, "scorer ranks", b))
        else:
            b = half * sh.num_params() // shard
            frozen_here += b
            roles.append(Role(name, False, "trained ranks", b))
    states = sum(r.states for r in roles if r.rank == "trained ranks")
    L, V = recipe.data.seq_length, shape.vocab_size
    kv = 2 * shape.num_layers * (shape.kv_size // d.tensor_parallel_size) * L * n_rollout * half if online else 0
    scoring = 8 * n_rollout * L * V  # fp32 logits + log-softmax of a whole rollout (no_grad)
    phases = {"update": max(sum(e.phases[p] for e in trained) for p in trained[0].phases) + frozen_here}
    if online:
        phases = {"rollout": states + kv, "experience": states + scoring, **phases}
    notes = []
    if separated:
        notes.append(
            f"separated: {h.scorer_ranks} scorer rank(s), each with whole copies of the frozen models in "
            f"{recipe.model.precision}; {d.world_size} trained rank(s) hold actor and critic"
        )
    elif frozen_here:
        notes.append(
            f"shared: the frozen models are sharded like the actor ({recipe.model.precision} storage) on every rank"
        )
    return AlignmentEstimate(
        stage.train_modes[0],
        "separated" if separated else "shared",
        roles,
        phases,
        frozen_there + scoring if separated else 0,
        kv,
        notes,
    )


def measure_resident(trainer) -> dict[str, int]:
    """What each model of a running alignment trainer holds on this rank, read off its tensors: parameters,
    and for a model that trains its gradients (as large as its trainable parameters, in fp32) and AdamW
    states. The measured side of :attr:`Role.states` (call it after at least one optimizer step)."""

    state = trainer.optimizer.state
    out = {}
    for name, model in trainer.models().items():
        params = list(model.parameters())
        trained = [p for p in params if p.requires_grad]
        grads = sum(4 * local_bytes(p) // p.element_size() for p in trained)  # (fp32 gradients)
        opt = sum(
            local_bytes(v)
            for p in trained
            for v in state.get(p, {}).values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
        out[name] = sum(local_bytes(p) for p in params) + grads + opt
    return out
