"""The vLLM rollout process: a small HTTP server around vLLM's offline ``LLM``, run by the interpreter of the vLLM
environment (``make vllm-env``), never imported by canntrain itself.

It imports only the standard library and vLLM, so it runs from its path in an environment where canntrain is not
installed (vLLM pins its own torch and transformers). The trainer (``engines/vllm_engine.py``) starts it, or attaches
to one a user started by hand:

    .venv-vllm/bin/python canntrain_core/engines/vllm_server.py --model HF_DIR --port 8765 [--dtype bfloat16 ...]

Endpoints (JSON in and out, one request at a time, in the order they arrive):

- ``GET /health``: ``{"version": N, "model": DIR}``;
- ``POST /generate``: prompts as token ids, ``n`` samples each, ``max_tokens``, ``temperature``, ``top_k``,
  ``stop_token_ids``, ``seed``; returns each sample's token ids, the log-probability the engine gave each of them
  (after temperature: what it sampled from), the weights version that sampled them and the seconds it took;
- ``POST /load_weights``: ``{"path": DIR, "version": N}``: vLLM's in-place ``reload_weights`` from the safetensors
  in DIR, then the prefix cache reset (a cached prompt's keys were computed by the old weights);
- ``POST /join_weights``: ``{"host", "port", "size", "timeout_s"}``: every worker joins the trainer's weight group
  (``weight_sync.py``, this file's neighbour, which vLLM mixes into its workers);
- ``POST /receive_weights``: ``{"params": [[name, shape], ...], "dtype", "version"}``: every worker receives the
  tensors the trainer broadcasts, in that order, loading each as it arrives; then the prefix cache reset;
- ``POST /shutdown``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


class Engine:
    """One vLLM engine and the version of the weights it holds; every call runs on one thread, in arrival order."""

    def __init__(self, args):
        self.model, self.version = args.model, args.version
        kwargs = {"kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30)} if args.kv_cache_gib else {}
        self.llm = LLM(
            model=args.model,
            skip_tokenizer_init=True,  # prompts and samples are token ids: the trainer owns the tokenizer
            dtype=args.dtype,
            tensor_parallel_size=args.tensor_parallel_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len,
            enforce_eager=args.enforce_eager,
            seed=args.seed,
            logprobs_mode="processed_logprobs",  # after temperature: the distribution each token was drawn from
            generation_config="vllm",  # the recipe's sampling settings, not the model directory's defaults
            worker_extension_cls="weight_sync.WeightReceiver",  # the broadcast path's receiving end
            **({"distributed_executor_backend": "uni"} if args.single_process else {}),
            **kwargs,
        )
        self.jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._serve_jobs, daemon=True).start()

    def _serve_jobs(self) -> None:
        while True:
            fn, body, done = self.jobs.get()
            try:
                done.set_result(fn(body))
            except BaseException as e:  # the handler reports it to the client
                done.set_exception(e)

    def call(self, fn, body: dict) -> dict:
        done: Future = Future()
        self.jobs.put((fn, body, done))
        return done.result()

    def generate(self, body: dict) -> dict:
        started = time.perf_counter()
        n, prompts = body.get("n", 1), body["prompts"]
        if body.get("temperature", 1.0) == 0 and n > 1:  # vLLM takes greedy requests one sample at a time
            n, prompts = 1, [p for p in prompts for _ in range(n)]
        params = SamplingParams(
            n=n,
            max_tokens=body["max_tokens"],
            temperature=body.get("temperature", 1.0),
            top_k=body.get("top_k", 0),  # 0: the whole vocabulary
            stop_token_ids=body.get("stop_token_ids") or None,
            seed=body.get("seed"),
            logprobs=0,  # the sampled token's own log-probability
            detokenize=False,
        )
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        tokens, logprobs = [], []
        for out in outs:
            for c in out.outputs:
                tokens.append(list(c.token_ids))
                logprobs.append([step[t].logprob for t, step in zip(c.token_ids, c.logprobs or [])])
        seconds = time.perf_counter() - started
        return {"tokens": tokens, "logprobs": logprobs, "version": self.version, "seconds": seconds}

    def load_weights(self, body: dict) -> dict:
        started = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": body["path"]})
        self.llm.reset_prefix_cache()
        self.version = body["version"]
        return {"version": self.version, "seconds": time.perf_counter() - started}

    def join_weights(self, body: dict) -> dict:
        self.llm.collective_rpc("canntrain_join", kwargs=body)
        return {}

    def receive_weights(self, body: dict) -> dict:
        started = time.perf_counter()
        got = self.llm.collective_rpc("canntrain_receive", kwargs={"params": body["params"], "dtype": body["dtype"]})
        self.llm.reset_prefix_cache()
        self.version = body["version"]
        return {"version": self.version, "bytes": got[0], "seconds": time.perf_counter() - started}


def handler_for(engine: Engine, server_ref: list):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):  # one line per request on stderr is noise in the trainer's log
            pass

        def _reply(self, code: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._reply(200, {"version": engine.version, "model": engine.model})
            else:
                self._reply(404, {"error": f"no endpoint {self.path}"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            routes = {
                "/generate": engine.generate,
                "/load_weights": engine.load_weights,
                "/join_weights": engine.join_weights,
                "/receive_weights": engine.receive_weights,
            }
            if self.path == "/shutdown":
                self._reply(200, {})
                threading.Thread(target=server_ref[0].shutdown, daemon=True).start()
            elif self.path in routes:
                try:
                    self._reply(200, engine.call(routes[self.path], body))
                except Exception as e:
                    self._reply(500, {"error": f"{type(e).__name__}: {e}"})
            else:
                self._reply(404, {"error": f"no endpoint {self.path}"})

    return Handler


def _stop_with_parent(parent: int) -> None:
    """A trainer killed outright (SIGKILL, a node's OOM killer) cannot stop its engine, which would keep its devices:
    once the parent is gone this process group (the server and vLLM's own processes) ends."""
    while os.getppid() == parent:
        time.sleep(2)
    os.killpg(os.getpgid(0), signal.SIGKILL)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a Hugging Face model directory (config.json + safetensors)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--version", type=int, default=0, help="the version of the weights in --model (a step)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-gib", type=float, default=0.0, help="0: vLLM's default")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="stop when this process (the trainer that started the server) is gone, however it ended",
    )
    p.add_argument(
        "--single-process",
        action="store_true",
        help="vLLM's engine core and its one worker in this process (tensor parallel size 1); what a CPU engine "
        "beside the trainer wants: vLLM's processes busy-poll their queues for a second after each request",
    )
    args = p.parse_args(argv)
    # vLLM's workers import weight_sync.py from beside this file (this process has the folder on its path already,
    # as a script's; the engine-core processes vLLM starts get it from the environment)
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    if args.single_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read by vLLM when the engine is made
    if args.parent_pid:
        threading.Thread(target=_stop_with_parent, args=(args.parent_pid,), daemon=True).start()
    engine = Engine(args)
    ref: list = []
    server = ThreadingHTTPServer((args.host, args.port), handler_for(engine, ref))
    ref.append(server)
    print(f"canntrain vLLM rollout server ready on http://{args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
