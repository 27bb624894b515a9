"""The one way expected failures leave canntrain: an exception class per kind, each with its exit code.

Every failure a user can cause or fix (a bad recipe, data, checkpoint or run directory, a layout the
model cannot take, a device out of memory) raises a subclass of :class:`CanntrainError`. The command
line (``canntrain_core.cli.main``) prints its message as ``canntrain <command>: <message>`` on stderr,
without a traceback, and exits with its ``exit_code``:

====  =========================================================================
 2    bad input: recipe, data, checkpoint, run directory, layout, rank table
 3    the device ran out of memory (the message holds the estimate and a fix)
 1    anything else that failed as expected (e.g. a notebook cell, another rank)
====  =========================================================================

Any other exception is a bug and keeps its traceback. Notebooks see the same exceptions, whose
messages are written to be read there too.
"""

from __future__ import annotations

EXIT_BAD_INPUT = 2
EXIT_OUT_OF_MEMORY = 3
EXIT_FAILED = 1


class CanntrainError(Exception):
    """An expected failure; the message says what and where (file, key, line)."""

    exit_code = EXIT_FAILED


class BadInput(CanntrainError):
    """Input the user can fix: the message names the file, key or line."""

    exit_code = EXIT_BAD_INPUT


class OutOfMemory(CanntrainError):
    """The device ran out of memory; the message compares the estimate with the capacity and
    suggests the cheapest change that fits. Checkpoints already written stay intact."""

    exit_code = EXIT_OUT_OF_MEMORY


class NonFinite(CanntrainError):
    """A step's loss or gradients were NaN or inf (``optim.nonfinite: stop``); the message names the step and the
    last complete checkpoint to resume from."""


class RecipeError(BadInput, ValueError):
    """A recipe that cannot be used; the message says which file, key and line."""


class CollectiveFailed(CanntrainError):
    """A collective did not finish within ``distributed.timeout_seconds`` (or a peer's connection closed): the
    message names the collective, its group, this rank's step and the ranks that had not reached it, and the last
    complete checkpoint."""


class RolloutEngineFailed(CanntrainError):
    """The rollout engine (a vLLM process) did not start, died or refused a request: the message names the process,
    its log and the last complete checkpoint."""
