"""Experiment trackers (``logging.trackers``): every metrics.jsonl row's numbers, with the same names at the same
step, in the trackers teams compare runs in, and the resolved recipe as the run's config.

Each tracker is a :class:`~canntrain_core.train.metrics.MetricsLog` sink on the rank that writes metrics.jsonl,
started at the first record. Where it writes unless its own environment says otherwise (a user of W&B, MLflow or
SwanLab sets what they always set):

- ``tensorboard``: event files in ``<run_dir>/tensorboard`` (``tensorboard --logdir``);
- ``wandb``: online with an API key (``WANDB_API_KEY`` or ``wandb login``), else offline in ``<run_dir>/wandb``
  (``wandb sync`` uploads it); ``WANDB_MODE`` decides when set;
- ``mlflow``: the server or store of ``MLFLOW_TRACKING_URI``, else an SQLite store, ``<run_dir>/mlflow.db`` (MLflow's
  own default kind of store since its file store was frozen; ``mlflow ui --backend-store-uri sqlite:///...``);
- ``swanlab``: online with an API key (``SWANLAB_API_KEY`` or ``swanlab login``), else offline in
  ``<run_dir>/swanlog`` (``swanlab sync``); ``SWANLAB_MODE`` decides when set.

A resumed run continues the same tracker run: ``<run_dir>/trackers.json`` keeps each one's run id and the last
step it was sent. Rows a resumed run writes again (those after its checkpoint) are not sent twice: a resume is
bit-exact, so they are the numbers the tracker already holds (TensorBoard purges and rewrites them instead, as
metrics.jsonl does). A fresh start in the same directory starts new tracker runs.
"""

from __future__ import annotations

import importlib
import json
import os
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

from canntrain_core.errors import RecipeError

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "swanlab": "swanlab"}


def numbers(record: dict[str, Any]) -> dict[str, float]:
    """A record's numbers, by name (its lists, strings and flags left out; ``step`` is the step, not a metric)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def missing(tracker: str, e: ImportError) -> RecipeError:
    return RecipeError(
        f"logging.trackers: {tracker} needs the {PACKAGES[tracker]} package ({e}); install it with "
        f"`pip install {PACKAGES[tracker]}` (or `pip install -e .[dev]`), or take {tracker} out of logging.trackers"
    )


class TrackerState:
    """``<run_dir>/trackers.json``: each tracker's run id and the last step sent to it."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "trackers.json"

    def read(self) -> dict:
        return json.loads(self.path.read_text()) if self.path.is_file() else {}

    def update(self, tracker: str, **values) -> None:
        state = self.read()
        state[tracker] = {**state.get(tracker, {}), **values}
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.path)

    def forget(self) -> None:
        self.path.unlink(missing_ok=True)


class TensorBoardSink:
    """Each record's numbers as TensorBoard scalars in ``log_dir``, tagged with the metric's name at global step
    ``record["step"]``, flushed as written.

    The writer opens at the first record, so only the rank that writes metrics creates the directory. After
    ``truncate_after(step)`` (a resume, or -1 for a fresh start in the same run directory) the next writer opens
    with ``purge_step=step + 1``: TensorBoard's readers then drop the earlier events from that step on, and a
    resumed run shows each step once, as metrics.jsonl does. The writer closes when the sink is garbage-collected
    or the interpreter exits (nothing is lost before then: every record is flushed)."""

    def __init__(self, log_dir: str | Path):
        self.log_dir = Path(log_dir)
        self._summary_writer = summary_writer_class()  # a missing package is reported now, before any step
        self.writer = None
        self.purge_step: int | None = None

    def __call__(self, record: dict[str, Any]) -> None:
        if self.writer is None:
            self.writer = self._summary_writer(str(self.log_dir), purge_step=self.purge_step)
            self._close = weakref.finalize(self, self.writer.close)  # at the latest when the interpreter exits
        for key, value in numbers(record).items():
            self.writer.add_scalar(key, value, global_step=record["step"])
        self.writer.flush()

    def truncate_after(self, step: int) -> None:
        self.close()  # an open writer's events past ``step`` are purged by the next one
        self.purge_step = step + 1

    def close(self) -> None:
        if self.writer is not None:
            self._close()  # closes the writer now, once
            self.writer = None


def summary_writer_class():
    """torch's SummaryWriter, or a RecipeError naming ``logging.trackers`` when tensorboard is not installed."""
    try:
        # deferred: optional (tensorboard, about a second to import)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise missing("tensorboard", e) from None
    return SummaryWriter


class TrackerRun:
    """One tracker's run, continued across resumes: subclasses say how to start it, send numbers and finish."""

    name = ""

    def __init__(self, run_dir: Path, project: str, config: dict):
        self.run_dir, self.project, self.config = run_dir, project, config
        self.state = TrackerState(run_dir)
        self.run = None
        self.through = -1  # the last step this tracker holds

    def __call__(self, record: dict[str, Any]) -> None:
        if self.run is None:
            saved = self.state.read().get(self.name, {})
            self.through = saved.get("through", -1)
            self.run, run_id = self.start(saved.get("id"))
            self.state.update(self.name, id=run_id)
        if record["step"] <= self.through:  # a resumed run's rows up to where this tracker got: it has them
            return
        self.send(numbers(record), record["step"])
        self.through = record["step"]
        self.state.update(self.name, through=self.through)

    def truncate_after(self, step: int) -> None:
        if step < 0:  # a fresh start in this directory: new tracker runs
            self.state.forget()

    def close(self) -> None:
        if self.run is not None:
            self.finish()
            self.run = None

    def start(self, run_id: str | None) -> tuple[Any, str]:
        raise NotImplementedError

    def send(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError


def _logged_in(env_key: str, netrc_host: str) -> bool:
    netrc = Path.home() / ".netrc"
    return bool(os.environ.get(env_key)) or (netrc.is_file() and netrc_host in netrc.read_text(errors="replace"))


def optional(tracker: str, module: str):
    """An optional dependency's module, imported when its tracker is named (not at canntrain's import), or the
    one line saying which package ``logging.trackers`` needs."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise missing(tracker, e) from None


def mode(mode_env: str, key_env: str, netrc_host: str) -> str:
    """The tracker's own mode variable when set; else online where its API key is known, offline where not."""
    return os.environ.get(mode_env) or ("online" if _logged_in(key_env, netrc_host) else "offline")


class WandbRun(TrackerRun):
    name = "wandb"

    def __init__(self, run_dir: Path, project: str, config: dict):
        super().__init__(run_dir, project, config)
        self.wandb = optional("wandb", "wandb")

    def start(self, run_id):
        run = self.wandb.init(
            project=self.project,
            name=self.run_dir.name,
            id=run_id,
            resume="allow" if run_id else None,
            dir=str(self.run_dir),
            config=self.config,
            mode=mode("WANDB_MODE", "WANDB_API_KEY", "api.wandb.ai"),
            # the trainer's output stays its own; a run directory is no git checkout
            settings=self.wandb.Settings(console="off", silent=True, disable_git=True, save_code=False),
        )
        return run, run.id

    def send(self, values, step):
        self.run.log(values, step=step)

    def finish(self):
        self.run.finish()


class MLflowRun(TrackerRun):
    name = "mlflow"

    def __init__(self, run_dir: Path, project: str, config: dict):
        super().__init__(run_dir, project, config)
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        entities = optional("mlflow", "mlflow.entities")
        self.Metric, self.Param = entities.Metric, entities.Param
        self.client_class = optional("mlflow", "mlflow.tracking").MlflowClient
        if self.uri.startswith("sqlite:"):  # an SQLite store also needs these, which mlflow-skinny lacks
            optional("mlflow", "sqlalchemy"), optional("mlflow", "alembic")

    def start(self, run_id):
        with warnings.catch_warnings():  # MLflow's SQLAlchemy store warns of its own deprecated loader at start
            warnings.simplefilter("ignore", DeprecationWarning)
            self.client = self.client_class(tracking_uri=self.uri)
            return self._start(run_id)

    def _start(self, run_id):
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            return run_id, run_id
        found = self.client.get_experiment_by_name(self.project)
        experiment = found.experiment_id if found else self.client.create_experiment(self.project)
        run_id = self.client.create_run(experiment, run_name=self.run_dir.name).info.run_id
        params = [self.Param(k, str(v)[:6000]) for k, v in flatten(self.config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(run_id, params=params[i : i + 100])
        return run_id, run_id

    def send(self, values, step):
        now = int(time.time() * 1000)
        metrics = [self.Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # and at most 1000 metrics
            self.client.log_batch(self.run, metrics=metrics[i : i + 1000])

    def finish(self):
        self.client.set_terminated(self.run)


class SwanLabRun(TrackerRun):
    name = "swanlab"

    def __init__(self, run_dir: Path, project: str, config: dict):
        super().__init__(run_dir, project, config)
        self.swanlab = optional("swanlab", "swanlab")

    def start(self, run_id):
        chosen = mode("SWANLAB_MODE", "SWANLAB_API_KEY", "swanlab")
        online = chosen == "online"
        run = self.swanlab.init(
            project=self.project,
            name=self.run_dir.name,
            log_dir=str(self.run_dir / "swanlog"),
            mode=chosen,
            id=run_id if online else None,  # SwanLab resumes a run online only; offline: a new directory
            resume="allow" if run_id and online else None,
            config=self.config,
            reinit=True,
        )
        return run, run_id or run.id

    def send(self, values, step):
        self.run.log(values, step=step)

    def finish(self):
        self.run.finish()


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 3e-4}}`` → ``{"optim.lr": 3e-4}``: the recipe's keys as the command line writes them."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


RUNS = {"wandb": WandbRun, "mlflow": MLflowRun, "swanlab": SwanLabRun}


def tracker_sinks(recipe, run_dir: Path) -> list:
    """The sinks of ``logging.trackers``; a tracker whose package is missing stops the run here, naming it."""
    project = recipe.logging.tracker_project or recipe.experiment.name
    config = recipe.model_dump(mode="json")
    sinks = []
    for tracker in recipe.logging.trackers:
        if tracker == "tensorboard":
            sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        else:
            sinks.append(RUNS[tracker](run_dir, project, config))
    return sinks
