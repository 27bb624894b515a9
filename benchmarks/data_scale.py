"""The data path at scale, on this machine: prepare throughput against the tokenizer's own limit, prepare memory
against corpus size, training start-up against prepared corpus size, mixture proportions.

    .venv/bin/python benchmarks/data_scale.py throughput --mb 256     # prepare vs encode_batch vs datasets.map
    .venv/bin/python benchmarks/data_scale.py memory --mb 256 2048    # peak RSS of prepare per corpus size
    .venv/bin/python benchmarks/data_scale.py startup --mb 20 2048    # canntrain train to its first step
    .venv/bin/python benchmarks/data_scale.py mixture                 # 70/30 over 10,000 samples

The corpus is generated JSONL (Zipf-distributed words, punctuation and line breaks in documents of 0.2 to
8 KB), the tokenizer a 32,000-token byte-level BPE trained once on 16 MB of it. ``startup`` writes random token
ids as Megatron shards of the given size (what a prepared corpus is to the trainer) and times two starts of
``canntrain train`` on it: the first builds the train/val split index once, the second only maps files. Figures
vary with the CPU and the disk; benchmarks/README.md's table says which machine gave them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORK = Path(os.environ.get("CANNTRAIN_BENCH_DIR", tempfile.gettempdir())) / "canntrain-data-bench"


def corpus(mb: int) -> Path:
    """A generated JSONL corpus of about ``mb`` MB (made once, reused)."""
    path = WORK / f"corpus-{mb}mb.jsonl"
    if path.is_file():
        return path
    WORK.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    words = np.array([f"w{i}" if i % 7 else f"W{i}x" for i in range(50_000)])
    punct = np.array([" ", " ", " ", " ", " ", ", ", ". ", ".\n", "\n\n", "; "])
    tmp = path.with_suffix(".tmp")
    written = 0
    with open(tmp, "w") as f:
        while written < mb * 1_000_000:
            n = int(rng.integers(40, 1600))
            w = words[np.minimum(rng.zipf(1.2, n), len(words)) - 1]
            sep = punct[rng.integers(0, len(punct), n)]
            line = json.dumps({"id": written, "text": "".join(np.char.add(w, sep))}) + "\n"
            f.write(line)
            written += len(line)
    tmp.rename(path)
    return path


def tokenizer_dir() -> Path:
    d = WORK / "tokenizer-32k"
    if not (d / "tokenizer.json").is_file():
        from canntrain_core.data import train_tokenizer

        texts = [json.loads(line)["text"] for line in open(corpus(16))]
        d.mkdir(parents=True, exist_ok=True)
        (d / "tokenizer.json").write_text(train_tokenizer(texts, 32_000).to_str())
    return d


def texts_of(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in open(path)]


def throughput(mb: int) -> None:
    """MB/s of text: the tokenizer's own encode_batch in one process (its threads, then one thread), datasets.map
    with 2 processes, and canntrain prepare with 1 and 2 workers."""
    src, tok = corpus(mb), tokenizer_dir()
    rows = []
    for threads in ("default", "1"):
        code = (
            "import json,time,sys; from tokenizers import Tokenizer;"
            f"t=Tokenizer.from_file('{tok}/tokenizer.json'); texts=[json.loads(l)['text'] for l in open('{src}')];"
            "n=sum(len(x.encode()) for x in texts); s=time.perf_counter();"
            "[t.encode_batch(texts[i:i+512]) for i in range(0,len(texts),512)];"
            "print(n/(time.perf_counter()-s)/1e6)"
        )
        env = {**os.environ, **({"TOKENIZERS_PARALLELISM": "false"} if threads == "1" else {})}
        rate = float(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout)
        rows.append((f"tokenizers encode_batch, 1 process ({threads} threads)", rate))
    code = (
        "import datasets,json,time; from transformers import PreTrainedTokenizerFast;"
        f"t=PreTrainedTokenizerFast(tokenizer_file='{tok}/tokenizer.json');"
        f"ds=datasets.load_dataset('json',data_files='{src}',split='train',cache_dir='{WORK}/hf');"
        "n=sum(len(x.encode()) for x in ds['text']); s=time.perf_counter();"
        "ds.map(lambda b: t(b['text']),batched=True,num_proc=2,remove_columns=ds.column_names,"
        "load_from_cache_file=False);"
        "print(n/(time.perf_counter()-s)/1e6)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip().splitlines()
    rows.append(("datasets.map(num_proc=2) over the loaded dataset", float(out[-1])))
    for workers in (1, 2):
        rate = _prepare(src, tok, workers)["mb_s"]
        rows.append((f"canntrain prepare --workers {workers}", rate))
    print(f"throughput on {mb} MB of JSONL, MB/s of text:")
    for name, rate in rows:
        print(f"  {name:60s} {rate:6.2f}")


def _prepare(src: Path, tok: Path, workers: int) -> dict:
    out = Path(tempfile.mkdtemp(dir=WORK)) / "prepared"
    cmd = [sys.executable, "-m", "canntrain_core.cli", "prepare", str(src), "--tokenizer", str(tok), "-o", str(out)]
    cmd += ["--workers", str(workers), "--no-progress"]
    start = time.perf_counter()
    # GNU time's %M: the peak RSS of the largest process (the parent, or one worker)
    done = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - start
    manifest = json.loads((out / "manifest.json").read_text())
    peak_kb = int(done.stderr.strip().splitlines()[-1])
    subprocess.run(["rm", "-rf", str(out.parent)], check=True)
    return {"mb_s": manifest["text_bytes"] / 1e6 / seconds, "peak_mb": peak_kb / 1024, "seconds": seconds}


def memory(sizes: list[int]) -> None:
    tok = tokenizer_dir()
    print("peak RSS of canntrain prepare (largest process; 2 workers):")
    for mb in sizes:
        r = _prepare(corpus(mb), tok, 2)
        print(f"  {mb:6d} MB corpus: {r['peak_mb']:7.0f} MB peak RSS, {r['seconds']:6.1f} s, {r['mb_s']:.2f} MB/s")


def _synthetic_prepared(mb: int) -> Path:
    """Random token ids as Megatron shards (1 KB documents), ``mb`` MB of uint16 tokens."""
    from canntrain_core.data import ShardWriter

    d = WORK / f"tokens-{mb}mb"
    if (d / "done").is_file():
        return d
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    per_shard = 256 * 2**20 // 2  # tokens a shard
    total = mb * 1_000_000 // 2
    k = 0
    while total > 0:
        n = min(per_shard, total)
        w = ShardWriter(d / f"part-{k:04d}", np.uint16)
        tokens = rng.integers(1, 32_000, n, dtype=np.uint16)
        tokens[511::512] = 0  # an EOS every 512 tokens: 1 KB documents
        for doc in np.split(tokens, np.arange(512, n, 512)):
            w.add(doc)
        w.close()
        total -= n
        k += 1
    (d / "done").write_text("")
    return d


def startup(sizes: list[int]) -> None:
    tok = tokenizer_dir()
    print("canntrain train to the first step on a prepared corpus (tiny model, 1 process):")
    for mb in sizes:
        data = _synthetic_prepared(mb)
        cache = Path(tempfile.mkdtemp(dir=WORK))
        for attempt in ("first start", "second start"):
            run = Path(tempfile.mkdtemp(dir=WORK)) / "run"
            cmd = [
                sys.executable,
                "-m",
                "canntrain_core.cli",
                "train",
                str(ROOT / "cookbook/llama/configs/tiny_pretrain.yaml"),
            ]
            sets = {
                "data.source": str(data),
                "data.max_bytes": "null",
                "data.tokenizer.path": str(tok),
                "data.tokenizer.vocab_size": "32000",
                "data.cache_dir": str(cache),
                "optim.max_steps": "1",
                "logging.eval_interval": "1000",
                "logging.ckpt_interval": "1000",
            }
            for k, v in sets.items():
                cmd += ["--set", f"{k}={v}"]
            cmd += ["--run-dir", str(run), "--no-progress"]
            start = time.perf_counter()
            done = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], capture_output=True, text=True)
            wall = time.perf_counter() - start
            if done.returncode:
                raise SystemExit(done.stderr)
            peak = int(done.stderr.strip().splitlines()[-1]) / 1024
            info = json.loads((run / "data.json").read_text())
            print(
                f"  {mb:6d} MB of tokens, {attempt}: {wall:5.1f} s to the end of step 1, "
                f"data {info['total_seconds']:.2f} s, peak RSS {peak:5.0f} MB"
            )


def mixture() -> None:
    from canntrain_core.data import ResumableSampler

    s = ResumableSampler([50_000, 20_000], seed=0, weights=[0.7, 0.3])
    idx = np.asarray(s.indices(np.arange(10_000)))
    share = float((idx < 50_000).mean())
    print(f"mixture 70/30 over 10,000 samples: {share:.4f} / {1 - share:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("throughput", "memory", "startup", "mixture"))
    ap.add_argument("--mb", type=int, nargs="+", default=[256])
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.what == "throughput":
        throughput(args.mb[0])
    elif args.what == "memory":
        memory(args.mb)
    elif args.what == "startup":
        startup(args.mb)
    else:
        mixture()


if __name__ == "__main__":
    main()
