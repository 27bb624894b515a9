"""logging.trackers: W&B, MLflow and SwanLab get every metrics.jsonl number (same names, same steps) and the resolved
recipe, read back with each tracker's own reader (W&B's records in its offline run files, MLflow's client on its
SQLite store, SwanLab's reader of its offline log); a resumed run continues the same tracker run without sending a
step twice; a missing package is one line naming the key and the package."""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
import sys

import pytest

from canntrain_core.errors import RecipeError
from canntrain_core.train.metrics import read_metrics
from canntrain_core.train.trainer import Trainer

wandb = pytest.importorskip("wandb")
if importlib.util.find_spec("mlflow") is None:  # found, not imported: its import is 2.5 s
    pytest.skip("mlflow is not installed (the trackers extra)", allow_module_level=True)
from wandb.proto import wandb_internal_pb2  # noqa: E402

# SwanLab pins protobuf < 7, which transformers' SentencePiece conversion cannot run under (pyproject's swanlab
# extra): the dev environment leaves it out, and these tests take it in where it is installed (0.10 here, by hand)
SWANLAB = importlib.util.find_spec("swanlab") is not None
TRACKERS = ["wandb", "mlflow"] + ["swanlab"] * SWANLAB


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No tracker reaches a server from a test, whatever the machine's logins."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def wandb_records(run_dir):
    """W&B's own records (its protobuf) from the run's offline files, in order (a resume adds a file). W&B 0.31
    reads these files in its Go core only; the framing is LevelDB's log format (W&B's header, then records of a
    CRC, a length and a kind in 32 KiB blocks), which this unpacks."""
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        data = path.read_bytes()
        assert data[:4] == b":W&B"
        pos, parts = 7, b""
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if kind == 0:
                break
            parts += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a whole record, or a record's last part
                record = wandb_internal_pb2.Record()
                record.ParseFromString(parts)
                parts = b""
                yield record


def wandb_history(run_dir) -> dict[str, list[tuple[int, float]]]:
    got: dict[str, list[tuple[int, float]]] = {}
    for record in wandb_records(run_dir):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for key, value in row.items():
                if not key.startswith("_"):
                    got.setdefault(key, []).append((row["_step"], value))
    return got


def swanlab_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the run's offline logs (a resume offline adds a directory), through SwanLab's own reader."""
    from swanlab.proto.swanlab.record.v1 import record_pb2
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    got: dict[str, list[tuple[int, float]]] = {}
    for path in sorted((run_dir / "swanlog").glob("run-*/*.swanlab")):
        reader = DataStoreReader()
        reader.open(path)
        for data in reader:
            record = record_pb2.Record()
            record.ParseFromString(data)
            if record.HasField("scalar"):
                got.setdefault(record.scalar.key, []).append((record.scalar.step, record.scalar.value.number))
        reader.close()
    return got


def mlflow_client(run_dir):
    """MLflow's client on the run's store, imported here: 2.5 s that make test-fast should not pay at collection."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")


def mlflow_history(run_dir, run_id: str, keys) -> dict[str, list[tuple[int, float]]]:
    client = mlflow_client(run_dir)
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}


def jsonl(run_dir) -> dict[str, list[tuple[int, float]]]:
    got: dict[str, list[tuple[int, float]]] = {}
    for row in read_metrics(run_dir):
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                got.setdefault(key, []).append((row["step"], float(value)))
    return got


@pytest.mark.slow
def test_every_number_reaches_each_tracker_once_across_a_resume(tmp_path, fast_recipe):
    """Killed after step 9's row with its last checkpoint at 6: the resumed run writes rows 7-12 again. Each tracker
    holds each step once: 1-9 as the first attempt sent them (the losses are the same, a resume being bit-exact;
    the timings are that attempt's), 10-12 from the resumed one; metrics.jsonl holds the resumed run's."""
    recipe = fast_recipe(**{"optim.max_steps": 12, "logging.eval_interval": 4, "logging.trackers": TRACKERS})
    Trainer(recipe, run_dir=tmp_path, progress=False).fit(stop_after=9)  # checkpoints at 6 and 9
    first = json.loads((tmp_path / "trackers.json").read_text())
    assert {t: first[t]["through"] for t in TRACKERS} == dict.fromkeys(TRACKERS, 9)
    first_rows = jsonl(tmp_path)
    shutil.rmtree(tmp_path / "checkpoints" / "step_9")  # as if killed after step 9's row, before its checkpoint
    Trainer(recipe, run_dir=tmp_path, resume_from="auto", progress=False).fit()  # rewrites steps 7-12
    state = json.loads((tmp_path / "trackers.json").read_text())
    assert {t: state[t]["id"] for t in TRACKERS} == {t: first[t]["id"] for t in TRACKERS}  # the same runs
    final = jsonl(tmp_path)
    assert [s for s, _ in final["loss"]] == list(range(1, 13)) and [s for s, _ in final["val_loss"]] == [0, 4, 8, 12]
    want = {
        key: [(s, v) for s, v in first_rows.get(key, []) if s <= 9] + [(s, v) for s, v in final.get(key, []) if s > 9]
        for key in {*first_rows, *final}
    }
    for key in ("loss", "val_loss", "lr", "grad_norm"):  # what a resume recomputes exactly
        assert want[key] == final[key], key
    readers = {
        "wandb": lambda: wandb_history(tmp_path),
        "swanlab": lambda: swanlab_scalars(tmp_path),
        "mlflow": lambda: mlflow_history(tmp_path, state["mlflow"]["id"], want),
    }
    for name in TRACKERS:
        got = readers[name]()
        got = {k: v for k, v in got.items() if v}
        assert set(got) == set(want), (name, set(got) ^ set(want))
        for key in want:  # each step once, with the value sent
            assert sorted(got[key]) == want[key], (name, key)  # float64 throughout: exact


@pytest.mark.slow
def test_the_resolved_recipe_is_each_runs_config(tmp_path, fast_recipe):
    recipe = fast_recipe(
        **{"optim.max_steps": 2, "logging.trackers": ["mlflow", "wandb"], "logging.tracker_project": "p"}
    )
    Trainer(recipe, run_dir=tmp_path, progress=False).fit()
    state = json.loads((tmp_path / "trackers.json").read_text())
    client = mlflow_client(tmp_path)
    run = client.get_run(state["mlflow"]["id"])
    assert client.get_experiment(run.info.experiment_id).name == "p"
    assert run.data.params["optim.lr"] == str(recipe.optim.lr)
    assert run.data.params["train_mode"] == "pretrain"
    runs = [r.run for r in wandb_records(tmp_path) if r.WhichOneof("record_type") == "run"]
    config = {u.key: json.loads(u.value_json) for u in runs[0].config.update}
    assert config["optim"]["max_steps"] == 2 and config["logging"]["tracker_project"] == "p"


@pytest.mark.parametrize(
    ("tracker", "module", "package"),
    [("wandb", "wandb", "wandb"), ("mlflow", "mlflow.entities", "mlflow"), ("swanlab", "swanlab", "swanlab")],
)
def test_a_missing_package_is_one_line_naming_the_key(tmp_path, fast_recipe, monkeypatch, tracker, module, package):
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    with pytest.raises(RecipeError, match=rf"logging\.trackers: {tracker} needs the {package} package.*pip install"):
        Trainer(fast_recipe(**{"logging.trackers": [tracker]}), run_dir=tmp_path, progress=False)
    assert not (tmp_path / "metrics.jsonl").exists()
