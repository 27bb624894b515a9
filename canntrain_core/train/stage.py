"""The stage contract: what a stage (a ``train_mode``) gives the one training loop, and nothing more.

A stage is a subclass of :class:`~canntrain_core.train.trainer.Trainer` that overrides only the hooks of
:class:`Stage` below; the loop (``Trainer.fit``: steps, the schedule, logging, evaluation, checkpoints, resume,
failure handling) is every stage's and is never overridden. Pretraining is the Trainer itself; ``stages/``
holds the others, and ``stages/__init__.py`` checks each against this contract when it is imported
(:func:`check_stage`), so a stage that overrides a piece of the loop, or a hook with another signature, fails at
import rather than at step 1. torchtune writes its recipe interface the same way, as a Protocol that documents
and is not a vehicle for code reuse; the Trainer's own methods are the default hooks.

The order the loop calls them: ``build_data`` and ``build_model`` once (before a resume loads
``load_extra_state``); then per step ``batches`` gives the step's input and ``train_iteration`` trains on it
(the default: ``train_step``'s forward and backward over micro-batches, then the engine's optimizer step); at
``logging.log_interval`` ``log_record`` makes the row and ``postfix`` the progress bar's figures; at
``logging.eval_interval`` ``with_evaluation`` adds ``evaluate``'s figures; each checkpoint stores
``extra_state``; ``close`` runs last. The memory tools ask ``roles``, ``rows``, ``extra_ranks`` and ``models``.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar, Iterator, Protocol, runtime_checkable

import torch

# What a stage declares about itself (class attributes) and the engine reads, never the stage's name.
DECLARATIONS = (
    "train_modes",  # the train_mode values it trains: stages/__init__.py's STAGES maps each to it
    "language_model",  # where the language model sits in its model state ("" or PPO's "actor.")
    "not_a_language_model",  # why export and generate refuse its checkpoints (a reward model), else None
    "formats_conversations",  # its records are conversations: the chat template applies
    "plot",  # the picture `canntrain train` draws of a run: "loss" or "alignment"
    "token_weighted",  # its rows train unequal numbers of tokens: losses are means over trained tokens
)


class Stage(Protocol):
    """The hooks a stage may override (see the module docstring for when the loop calls each)."""

    train_modes: ClassVar[tuple[str, ...]]
    language_model: ClassVar[str]
    not_a_language_model: ClassVar[str | None]
    formats_conversations: ClassVar[bool]
    plot: ClassVar[str]
    token_weighted: ClassVar[bool]

    @staticmethod
    def extra_ranks(recipe) -> int:
        """Processes of the job beyond the trained model's layout (PPO's separated frozen models)."""

    @staticmethod
    def roles(recipe) -> list[tuple[str, bool, bool]]:
        """(name, trains, scalar head) of each model a rank holds: what the alignment memory estimate counts."""

    @staticmethod
    def rows(recipe) -> tuple[int, int]:
        """(rows of one optimizer update, rows one rollout samples) per rank: the memory estimate's batch."""

    def build_data(self, config) -> Any:
        """The data bundle: ``train_loader()``, ``val_batches(...)``, ``sampler``, ``decode``, ``info``."""

    def build_model(self, config, fill: bool) -> Any:
        """The model it trains (a ``models.lifecycle.BuiltModel``); ``fill``: load weights (not on a resume). What
        else the build makes for the stage to hold (a reference model, a critic, their state) is returned in the
        BuiltModel's ``held``, which the engine sets on the trainer: never set by the builder as a side effect."""

    def models(self) -> dict:
        """The models it holds, by role: what the memory tools measure."""

    def batches(self) -> Iterator:
        """What each step trains on, in order (the sampler advanced by what it hands out)."""

    def train_iteration(self, micro_batches: list) -> dict:
        """One step on what ``batches`` gave: the raw figures ``log_record`` reads."""

    def train_step(self, micro_batches: list) -> torch.Tensor:
        """Forward and backward over a step's micro-batches (the default ``train_iteration``'s); its loss."""

    def log_record(self, raw: dict, last: bool) -> dict[str, Any]:
        """The metrics row of a logged step from ``train_iteration``'s figures."""

    def with_evaluation(self, record: dict, raw: dict) -> dict:
        """``record`` with this step's evaluation."""

    def evaluate(self) -> dict[str, float]:
        """The held-out figures (val_loss, val_accuracy, val_score, ...)."""

    def postfix(self, raw: dict, record: dict) -> dict | None:
        """The progress bar's figures after a step (None: unchanged)."""

    def extra_state(self) -> dict:
        """What it adds to each checkpoint's trainer state (PPO: its adaptive KL coefficient)."""

    def load_extra_state(self, state: dict) -> None:
        """Restore what ``extra_state`` saved."""

    def close(self) -> None:
        """What it releases when the loop ends, finished or not."""


@runtime_checkable
class DataBundle(Protocol):
    """What every stage's data (``build_data``) gives the engine, whatever it holds (token windows, packed SFT
    rows, preference pairs, prompts): the same names mean the same in every stage, so ``data.num_workers`` or a
    resumed position does too. ``tests/stages/test_stage_contract.py`` checks each stage's bundle against it."""

    tokenizer: Any  # a tokenizers.Tokenizer
    eos_id: int
    vocab_size: int  # the model's embedding rows
    sampler: Any  # data.sampler.ResumableSampler: the job's position, kept in every checkpoint
    info: dict  # what was read, skipped and built (the run directory's data.json)
    names: list  # the sources of a mixture, as their metrics name them

    def train_loader(self) -> Any:
        """The training batches of this rank, from the sampler's position (data.num_workers, persistent_workers)."""

    def val_batches(self, n_samples: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> list:
        """This rank's share of ``n_samples`` held-out samples, in batches: the same at every evaluation."""

    def decode(self, ids) -> str:
        """The text of token ids, special tokens shown."""


HOOKS = frozenset(
    name
    for name, value in vars(Stage).items()
    if not name.startswith("_") and (callable(value) or isinstance(value, staticmethod))
)


def check_stage(stage: type, engine: type) -> None:
    """Raise TypeError naming what breaks the contract: ``stage`` is not an ``engine`` subclass, declares no
    train_modes, overrides a method of the engine that is not a hook (the loop, its helpers), or a hook with
    other parameters than :class:`Stage` gives it."""
    if not issubclass(stage, engine):
        raise TypeError(f"{stage.__name__}: a stage subclasses {engine.__name__} (train/stage.py)")
    if not stage.train_modes:
        raise TypeError(f"{stage.__name__}: declares no train_modes")
    for cls in stage.__mro__[: stage.__mro__.index(engine)]:
        for name, value in vars(cls).items():
            if name.startswith("__") or name in DECLARATIONS or not hasattr(engine, name):
                continue  # the stage's own helpers are its business
            if name not in HOOKS:
                raise TypeError(
                    f"{cls.__name__}.{name} overrides the loop's {engine.__name__}.{name}; a stage overrides only the "
                    f"hooks of train/stage.py's Stage: {', '.join(sorted(HOOKS))}"
                )
            ours, theirs = parameters_of(value), parameters_of(vars(Stage)[name])
            if len(ours) != len(theirs) or isinstance(value, staticmethod) != isinstance(
                vars(Stage)[name], staticmethod
            ):
                raise TypeError(
                    f"{cls.__name__}.{name}({', '.join(ours)}): the Stage hook is {name}({', '.join(theirs)})"
                    f"{' (a staticmethod)' if isinstance(vars(Stage)[name], staticmethod) else ''} (train/stage.py)"
                )


def parameters_of(fn) -> tuple[str, ...]:
    """The parameters the loop passes (not self)."""
    fn = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
    fn = fn.fget if isinstance(fn, property) else fn
    return tuple(p for p in inspect.signature(fn).parameters if p != "self")
