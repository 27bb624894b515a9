"""``canntrain prepare``: raw sources → a prepared dataset, once, before training (the cann-recipes-train
articles: tokenize offline, train from token ids on disk).

A prepared dataset is a directory:

    manifest.json        written last: sources, tokenizer, counts, shards, fingerprint (its presence = complete)
    plan.json            the inputs, their units and the settings: what a resumed or multi-node run checks
    tokenizer/           the tokenizer the ids mean (tokenizer.json and, when it had them, its config files)
    shards/NNNNN.bin     one Megatron indexed dataset per unit (``data/indexed.py``): Megatron-LM and
    shards/NNNNN.idx     MindSpeed-LLM read each as a data prefix
    shards/NNNNN.json    the unit's counts and token hash, written after its pair (its presence = done)

Every document is encoded as the tokenizer encodes it (``add_special_tokens``: Llama's BOS, none for GPT-2 or
Qwen) followed by the tokenizer's EOS; a special token's text inside a document stays text. Units
(``data/corpus.py``) depend only on the inputs, so the shards are the same whatever ``workers`` and
``num_nodes`` were: N worker processes on a node take its units in turn, and node ``k`` of ``m`` takes units
``k, k+m, ...``; whichever finishes the last unit writes the manifest. A killed preparation resumes: finished
units are kept, a half-written one is written again. Memory per worker is one unit's document lengths (4 bytes a
document) and one encoding batch, never the corpus.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from canntrain_core.data.cache import DataError, atomic_write_text, file_lock, sha256_text
from canntrain_core.data.corpus import (
    BadRecords,
    Input,
    Unit,
    list_inputs,
    make_units,
    read_unit,
    sample_texts,
    select,
)
from canntrain_core.data.indexed import ShardWriter, bin_path, idx_path, token_dtype
from canntrain_core.data.tokenizer import (
    EOS_TOKEN,
    TrainedTokenizer,
    load_tokenizer_dir,
    tokenizer_identity,
    tokenizer_files,
    train_tokenizer,
)

FORMAT = "canntrain-prepared-dataset"
VERSION = 1
MANIFEST, PLAN = "manifest.json", "plan.json"
_BATCH_BYTES = 1 << 20  # text per encode_batch call: enough for the tokenizer, small enough to stream
_MIN_UNIT, _MAX_UNIT = 8 << 20, 512 << 20


def default_unit_bytes(total_bytes: int) -> int:
    """About 32 units for the corpus, each between 8 MiB and 512 MiB: enough to share among workers and nodes,
    few enough files for a 1 TB corpus (about 2,000 shards)."""
    return int(min(max(total_bytes // 32, _MIN_UNIT), _MAX_UNIT))


@dataclass(frozen=True)
class PrepareOptions:
    text_field: str = "text"
    on_bad_record: str = "error"
    unit_bytes: int | None = None  # None: default_unit_bytes of the corpus
    max_bytes: int | None = None  # a deterministic subset (tiny recipes); None: everything
    max_files: int | None = None

    def settings(self) -> dict[str, Any]:
        return {"text_field": self.text_field, "on_bad_record": self.on_bad_record}


@dataclass(frozen=True)
class PrepareResult:
    out: Path
    manifest: dict | None  # None while other nodes still have units to do
    seconds: float
    units_done_here: int
    cache_hit: bool  # nothing was left to do


class Plan:
    """The inputs, units, tokenizer and settings of one preparation (``plan.json``)."""

    def __init__(self, data: dict):
        self.data = data
        self.inputs = [Input(**i) for i in data["inputs"]]
        self.units = [Unit.from_json(u) for u in data["units"]]

    @classmethod
    def make(cls, sources: list[str], opts: PrepareOptions, tokenizer_sha: str | None) -> "Plan":
        inputs: list[Input] = []
        for s in sources:
            inputs += list_inputs(s)
        if not inputs:
            raise DataError(f"data source {', '.join(map(str, sources))}: no files found")
        inputs = select(inputs, opts.max_bytes, opts.max_files)
        total = sum(i.size for i in inputs)
        units = make_units(inputs, opts.unit_bytes or default_unit_bytes(total))
        data = {
            "format": FORMAT,
            "version": VERSION,
            "sources": [str(s) for s in sources],
            "settings": opts.settings() | {"max_bytes": opts.max_bytes, "max_files": opts.max_files},
            "tokenizer_sha256": tokenizer_sha,
            "inputs": [i.__dict__ | {"row_groups": list(i.row_groups)} for i in inputs],
            "units": [u.to_json() for u in units],
        }
        return cls(data)

    def same_work(self, other: "Plan") -> bool:
        keys = ("format", "version", "settings", "inputs", "units")
        ok = all(self.data[k] == other.data[k] for k in keys)
        mine, theirs = self.data["tokenizer_sha256"], other.data["tokenizer_sha256"]
        return ok and (mine is None or theirs is None or mine == theirs)


def shard_prefix(out: Path, u: int) -> Path:
    return out / "shards" / f"{u:05d}"


def prepare(
    sources: list[str],
    out: str | Path,
    tokenizer: str | Path | TrainedTokenizer | None = None,
    train_vocab: int | None = None,
    sample_bytes: int = 100_000_000,
    workers: int = 1,
    node_rank: int = 0,
    num_nodes: int = 1,
    opts: PrepareOptions = PrepareOptions(),
    progress: bool = True,
) -> PrepareResult:
    """Prepare ``sources`` into ``out`` (see the module docstring). ``tokenizer``: a pretrained tokenizer
    directory (or one already loaded); else ``train_vocab`` trains a byte-level BPE on ``sample_bytes`` of the
    corpus. Returns the manifest once every unit is done (None on a node that finished before the others)."""
    start = time.perf_counter()
    if workers < 1 or num_nodes < 1 or not 0 <= node_rank < num_nodes:
        raise DataError(f"need workers >= 1 and 0 <= node_rank < num_nodes, got {workers}, {node_rank}, {num_nodes}")
    if tokenizer is None and train_vocab is None:
        raise DataError("prepare needs a tokenizer: --tokenizer DIR (a pretrained one) or --train-tokenizer VOCAB")
    out = Path(out).expanduser()
    # What can be wrong with the inputs is found before anything is written: the tokenizer, the listing.
    given = load_tokenizer_dir(tokenizer, what="--tokenizer") if isinstance(tokenizer, (str, Path)) else tokenizer
    fresh = Plan.make(sources, opts, given.sha256 if given else None)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"{out}: cannot create the output directory ({e.strerror or e})") from None
    try:
        return _prepare_into(
            out, fresh, given, train_vocab, sample_bytes, workers, node_rank, num_nodes, opts, progress, start
        )
    except DataError:
        if created:  # a bad input: what this run began is of no use (fixing the input changes the plan)
            shutil.rmtree(out, ignore_errors=True)
        raise


def _prepare_into(out, fresh, given, train_vocab, sample_bytes, workers, node_rank, num_nodes, opts, progress, start):
    if (out / MANIFEST).is_file() and not (out / PLAN).is_file():
        raise DataError(f"{out}: holds a manifest but no plan; not a preparation this command can resume")
    with file_lock(out / ".lock"):
        plan = _plan(out, fresh, opts, given, train_vocab, sample_bytes)
    tok = load_tokenizer_dir(out / "tokenizer", what=str(out / "tokenizer"))
    if (out / MANIFEST).is_file():
        manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
        return PrepareResult(out, manifest, time.perf_counter() - start, 0, True)
    todo = [u for u in range(len(plan.units)) if u % num_nodes == node_rank and not _done(out, u)]
    dtype = token_dtype(tok.tokenizer.get_vocab_size())
    total = sum(plan.units[u].nbytes for u in todo)
    with _Progress(total, progress and bool(todo)) as bar:
        if workers == 1 or len(todo) <= 1:
            budget = _Budget(opts.max_bytes) if opts.max_bytes and _has_records(plan) else None
            for u in todo:
                _prepare_unit(out, plan, u, tok, dtype, opts, bar.add, budget)
        else:
            _run_pool(out, plan, todo, dtype, opts, workers, bar)
    with file_lock(out / ".lock"):
        manifest = _finish(out, plan, tok, time.perf_counter() - start, workers)
    return PrepareResult(out, manifest, time.perf_counter() - start, len(todo), False)


def _has_records(plan: Plan) -> bool:
    return any(i.kind != "text" for i in plan.inputs)


def _plan(out, fresh: Plan, opts, given, train_vocab, sample_bytes) -> Plan:
    """Write (or check) plan.json and the tokenizer directory; the first process to get here does it."""
    path = out / PLAN
    if path.is_file():
        existing = Plan(json.loads(path.read_text(encoding="utf-8")))
        if not existing.same_work(fresh):
            raise DataError(
                f"{out}: holds the preparation of other inputs, settings or tokenizer ({PLAN}); choose another "
                "output directory, or delete it to start over"
            )
        return existing
    if given is None:
        bad = BadRecords(opts.on_bad_record)
        sample = sample_texts(fresh.inputs, fresh.units, opts.text_field, bad, sample_bytes)
        if not sample.texts:
            raise DataError(f"{', '.join(fresh.data['sources'])}: no text to train a tokenizer on")
        tok = train_tokenizer(sample.texts, train_vocab)
        eos = tok.token_to_id(EOS_TOKEN)
        given = TrainedTokenizer(tok, out / "tokenizer" / "tokenizer.json", tokenizer_identity(tok), eos, False, 0.0)
        fresh.data["tokenizer_trained_on_bytes"] = sample.n_bytes
    _write_tokenizer(out / "tokenizer", given)
    fresh.data["tokenizer_sha256"] = given.sha256
    atomic_write_text(path, json.dumps(fresh.data, indent=1) + "\n")
    return fresh


def _write_tokenizer(directory: Path, tok: TrainedTokenizer) -> None:
    """tokenizer.json and the files transformers writes beside it (special tokens, chat template)."""
    directory.mkdir(parents=True, exist_ok=True)
    files = tokenizer_files(tok.tokenizer, tok.eos_id, tok.hf, tok.hf.chat_template if tok.hf is not None else None)
    files["tokenizer.json"] = tok.tokenizer.to_str()
    for name, text in files.items():
        atomic_write_text(directory / name, text)


def _done(out: Path, u: int) -> bool:
    return shard_prefix(out, u).with_suffix(".json").is_file()


class _Budget:
    """``data.max_bytes`` over record inputs in one process: text taken so far."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0


def _prepare_unit(out: Path, plan: Plan, u: int, tok: TrainedTokenizer, dtype, opts, report, budget=None) -> None:
    """Encode unit ``u`` into its shard: written under temporary names, renamed, then its .json (done)."""
    final = shard_prefix(out, u)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp")
    done_file = final.with_suffix(".json")
    stray = final.parent.glob(f".{done_file.name}.*.tmp")  # a kill inside atomic_write_text of the .json
    for p in (bin_path(tmp), idx_path(tmp), bin_path(final), idx_path(final), *stray):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()  # what a killed run left of this unit
    bad = BadRecords(opts.on_bad_record)
    writer = ShardWriter(tmp, dtype)
    text_bytes = 0
    try:
        batch: list[str] = []
        size = 0
        for text in read_unit(plan.inputs, plan.units[u], opts.text_field, bad):
            n = len(text.encode("utf-8"))
            if budget is not None:
                if budget.used + n > budget.limit:
                    continue
                budget.used += n
            batch.append(text)
            size += n
            if size >= _BATCH_BYTES:
                report(size, _encode(batch, tok, dtype, writer))
                text_bytes += size
                batch, size = [], 0
        if batch:
            report(size, _encode(batch, tok, dtype, writer))
            text_bytes += size
        writer.close()
    except BaseException:
        writer.abort()
        raise
    os.replace(bin_path(tmp), bin_path(final))
    os.replace(idx_path(tmp), idx_path(final))
    stats = {
        "documents": writer.documents,
        "tokens": writer.tokens,
        "text_bytes": text_bytes,
        "sha256": writer.sha256,
        "bad_records": bad.count,
        "bad_record_examples": bad.examples,
    }
    atomic_write_text(done_file, json.dumps(stats) + "\n")


def _encode(texts: list[str], tok: TrainedTokenizer, dtype, writer: ShardWriter) -> int:
    """Encode a batch of documents (each followed by EOS) into the shard; the number of tokens written."""
    t = tok.tokenizer
    t.encode_special_tokens = True  # a literal "<|endoftext|>" in a document is text, not a boundary
    try:
        encodings = t.encode_batch(texts, add_special_tokens=True)
    finally:
        t.encode_special_tokens = False
    n = 0
    for enc in encodings:
        ids = np.empty(len(enc.ids) + 1, dtype=dtype)
        ids[:-1] = enc.ids
        ids[-1] = tok.eos_id
        writer.add(ids)
        n += ids.size
    return n


# ---------------------------------------------------------------------------- worker processes

_WORKER: dict[str, Any] = {}


def _init_worker(out: str, plan_data: dict, dtype: str, opts: PrepareOptions, counters) -> None:
    _WORKER.update(
        out=Path(out),
        plan=Plan(plan_data),
        tok=load_tokenizer_dir(Path(out) / "tokenizer"),
        dtype=np.dtype(dtype),
        opts=opts,
        counters=counters,
    )


def _worker_unit(u: int) -> int:
    w = _WORKER
    counters = w["counters"]

    def report(nbytes: int, ntokens: int) -> None:
        with counters.get_lock():
            counters[0] += nbytes
            counters[1] += ntokens

    _prepare_unit(w["out"], w["plan"], u, w["tok"], w["dtype"], w["opts"], report)
    return u


def _run_pool(out: Path, plan: Plan, todo: list[int], dtype, opts, workers: int, bar: "_Progress") -> None:
    """The units on ``workers`` processes, one tokenizer thread each (N processes use N cores; the tokenizer's
    own thread pool would oversubscribe them)."""
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    counters = ctx.Array("q", 2)
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        with cf.ProcessPoolExecutor(
            max_workers=min(workers, len(todo)),
            mp_context=ctx,
            initializer=_init_worker,
            initargs=(str(out), plan.data, np.dtype(dtype).name, opts, counters),
        ) as pool:
            pending = {pool.submit(_worker_unit, u) for u in todo}
            seen = [0, 0]
            while pending:
                done, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_EXCEPTION)
                with counters.get_lock():
                    now = [counters[0], counters[1]]
                bar.add(now[0] - seen[0], now[1] - seen[1])
                seen = now
                for f in done:
                    if f.exception() is not None:
                        for p in pending:
                            p.cancel()
                        raise f.exception()
    except cf.process.BrokenProcessPool:
        raise DataError(f"{out}: a prepare worker died (out of memory?); run the same command again to resume")
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


class _Progress:
    """A tqdm bar of text bytes (MB/s) with tokens/s beside it."""

    def __init__(self, total: int, enabled: bool):
        self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=not enabled, delay=1.0)
        self.tokens, self.t0 = 0, time.perf_counter()

    def add(self, nbytes: int, ntokens: int) -> None:
        self.tokens += ntokens
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{rate / 1e3:,.0f}k tokens/s", refresh=False)
        self.bar.update(nbytes)

    def __enter__(self) -> "_Progress":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None and self.bar.total:
            self.bar.update(max(self.bar.total - self.bar.n, 0))
        self.bar.close()


# ---------------------------------------------------------------------------- the manifest


def _finish(out: Path, plan: Plan, tok: TrainedTokenizer, seconds: float, workers: int) -> dict | None:
    """Write manifest.json once every unit is done (by whichever process finishes last); None before that."""
    if (out / MANIFEST).is_file():
        return json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    if not all(_done(out, u) for u in range(len(plan.units))):
        return None
    shards, bad, examples = [], 0, []
    for u in range(len(plan.units)):
        stats = json.loads(shard_prefix(out, u).with_suffix(".json").read_text(encoding="utf-8"))
        bad += stats["bad_records"]
        examples += stats["bad_record_examples"][: 10 - len(examples)]
        if stats["documents"]:
            prefix = shard_prefix(out, u).relative_to(out).as_posix()
            shards.append({"prefix": prefix} | {k: stats[k] for k in ("documents", "tokens", "text_bytes", "sha256")})
    if not shards:
        raise DataError(f"{', '.join(plan.data['sources'])}: no usable documents ({bad} bad record(s): {examples[:3]})")
    fingerprint = sha256_text(json.dumps([tok.sha256] + [[s["sha256"], s["tokens"]] for s in shards]))
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "sources": plan.data["sources"],
        "inputs": len(plan.inputs),
        "settings": plan.data["settings"],
        "tokenizer": {
            "dir": "tokenizer",
            "sha256": tok.sha256,
            "vocab_size": tok.tokenizer.get_vocab_size(),
            "eos_id": tok.eos_id,
            "trained_on_bytes": plan.data.get("tokenizer_trained_on_bytes"),
        },
        "dtype": token_dtype(tok.tokenizer.get_vocab_size()).name,
        "documents": sum(s["documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "text_bytes": sum(s["text_bytes"] for s in shards),
        "bad_records": bad,
        "bad_record_examples": examples,
        "shards": shards,
        "fingerprint": fingerprint,
        "seconds_last_run": round(seconds, 3),
        "workers_last_run": workers,
    }
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def remove_incomplete(out: Path) -> None:
    """Delete a preparation that never finished (a cache entry whose build failed)."""
    if out.is_dir() and not (out / MANIFEST).is_file():
        shutil.rmtree(out, ignore_errors=True)
