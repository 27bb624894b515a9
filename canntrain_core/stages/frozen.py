"""PPO's frozen models, the reference and the reward model, where ``rlhf.device_placement`` puts them.

- ``shared``: they live in the trainer's own processes (sharded like the actor under FSDP2); memory per
  rank is the sum of all four models. :class:`FrozenModels` scores a rollout in place.
- ``separated``: they live on ``rlhf.scorer_ranks`` processes of their own (ranks ``world_size`` and up,
  outside the trainer's process group; each holds whole copies), and actor rank ``a`` is served by scorer
  ``world_size + a % scorer_ranks``. The actor side's :class:`RemoteFrozenModels` sends the rollout's ids
  and response mask over a gloo group and gets back what :class:`FrozenModels` would have computed; the
  scorer side runs :func:`serve`. The bytes are small (token ids, one float per token) and go through host
  memory, as verl passes rollouts between its worker groups.

Either way one call, ``frozen(ids, mask) -> (reference log-probabilities [N, L - 1] or None, reward-model
scores [N] or None)``, so the PPO loop does not know where the models are.
"""

from __future__ import annotations

from pathlib import Path

import torch

from canntrain_core import checkpoint
from canntrain_core.checkpoint.dcp import load_model_weights
from canntrain_core.errors import BadInput
from canntrain_core.models.lifecycle import build_frozen_model
from canntrain_core.models.rollout import token_logprobs

STOP, SCORE = 0, 1


def sequence_scores(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A scalar-head model's score of each row at its answer's last token: [N]. ``mask`` [N, L - 1] marks
    the answer's target positions (``Rollout.mask``), so the last token is ids[last + 1]."""
    last = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(-1) + 1
    values = model(ids)[..., 0]  # [N, L]: the score after reading ids[:t + 1]
    return values.gather(1, last[:, None]).squeeze(1).float()


def reward_checkpoint(path: str | Path) -> Path:
    """``rlhf.reward_model``: a reward run's directory (its newest complete checkpoint) or a checkpoint;
    verified against its manifest."""
    path = Path(path)
    found = checkpoint.latest_checkpoint(path / "checkpoints") if (path / "checkpoints").is_dir() else path
    if found is None or not (found / "manifest.json").is_file():
        raise BadInput(f"rlhf.reward_model: {path} holds no complete checkpoint of a train_mode reward run")
    if found == path:
        checkpoint.verify_checkpoint(found)  # (latest_checkpoint verified the one it found)
    mode = checkpoint.checkpoint_recipe(found).get("train_mode")
    if mode != "reward":
        raise BadInput(f"rlhf.reward_model: {found} was written by a train_mode {mode} run, not reward")
    return found


class FrozenModels:
    """The reference (None when ``rlhf.kl_coeff`` is 0) and the reward model (None: the programmatic scorer)."""

    def __init__(self, reference, reward_model, temperature: float):
        self.reference, self.reward_model, self.temperature = reference, reward_model, temperature

    @classmethod
    def build(cls, recipe, config, device, mesh=None, dims=None, reward_ckpt=None) -> "FrozenModels":
        """The frozen models of ``recipe``, laid out by ``mesh``/``dims`` (shared placement: as the actor), held in
        the recipe's 16-bit precision when it has one (they never train: ``build_frozen_model``);
        ``reward_ckpt``: :func:`reward_checkpoint` of ``rlhf.reward_model``, already verified."""
        h = recipe.rlhf
        reference = reward = None
        if h.kl_coeff > 0:  # always the init_from weights
            reference = build_frozen_model(recipe, config, device, mesh, dims)
        if h.reward_model:
            reward = build_frozen_model(recipe, config, device, mesh, dims, fill=False, head="scalar")
            load_model_weights(reward_ckpt or reward_checkpoint(h.reward_model), reward, verify=reward_ckpt is None)
        return cls(reference, reward, h.temperature)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, mask: torch.Tensor):
        ref = token_logprobs(self.reference, ids, self.temperature) if self.reference is not None else None
        scores = sequence_scores(self.reward_model, ids, mask) if self.reward_model is not None else None
        return ref, scores

    def close(self) -> None:
        pass


class RemoteFrozenModels:
    """The actor side of separated placement: the same call, answered by scorer rank ``peer``."""

    def __init__(self, group, peer: int, has_reference: bool, has_reward: bool):
        self.group, self.peer, self.has_reference, self.has_reward = group, peer, has_reference, has_reward

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor):
        device = ids.device
        ids, mask = ids.cpu(), mask.float().cpu()
        self._send(torch.tensor([SCORE, *ids.shape]), ids, mask)
        ref = torch.empty(mask.shape) if self.has_reference else None
        scores = torch.empty(ids.shape[0]) if self.has_reward else None
        for t in (ref, scores):
            if t is not None:
                self.group.recv([t], self.peer, 0).wait()
        return tuple(None if t is None else t.to(device) for t in (ref, scores))

    def close(self) -> None:
        self._send(torch.tensor([STOP, 0, 0]))

    def _send(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self.group.send([t], self.peer, 0).wait()


def serve(frozen: FrozenModels, group, clients: list[int], device) -> int:
    """The scorer side: answer each client's requests, in turn, until every one has said stop; returns
    the number of rollouts scored. Clients take turns because each PPO iteration sends one request per
    actor rank, in lockstep."""
    served, live = 0, list(clients)
    while live:
        for client in list(live):
            header = torch.empty(3, dtype=torch.long)
            group.recv([header], client, 0).wait()
            op, n, length = header.tolist()
            if op == STOP:
                live.remove(client)
                continue
            ids, mask = torch.empty((n, length), dtype=torch.long), torch.empty((n, length - 1))
            for t in (ids, mask):
                group.recv([t], client, 0).wait()
            ref, scores = frozen(ids.to(device), mask.to(device))
            for t in (ref, scores):
                if t is not None:
                    group.send([t.float().cpu().contiguous()], client, 0).wait()
            served += 1
    return served
