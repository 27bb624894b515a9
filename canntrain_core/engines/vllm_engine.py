"""vLLM as the generation side of GRPO and PPO (``rlhf.rollout.backend: vllm``): a separate process, as the
cann-recipes-train articles' "two independent processes" and verl's and TRL's server modes.

The engine runs ``engines/vllm_server.py`` under the vLLM environment's interpreter (``rlhf.rollout.python``; vLLM pins
its own torch and transformers, so it never shares canntrain's environment), on the devices ``rlhf.rollout.devices``
names. Rank 0 starts it and stops it with the run; with ``rlhf.rollout.url`` it attaches to one already running and
leaves it running. Every data-parallel rank sends its own prompts; the server runs requests one at a time in the
order they arrive.

Weights travel through the file system, the portable path: after each update every rank of the trained model takes
part in writing the policy as safetensors (``checkpoint/live.py``), rank 0 writes them under
``<run_dir>/rollout/weights`` and asks the engine to reload them in place (vLLM's ``reload_weights``) and to drop its
prefix cache, whose keys the old weights computed. With ``rlhf.rollout.weight_sync: broadcast`` no file is written
after the start: rank 0 broadcasts each tensor to the engine's workers over a process group of their own (gloo, NCCL
or HCCL: ``weight_sync.py``). Each sample carries the version (the step) of the weights that drew it.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from canntrain_core.engines.weight_sync import open_group, start_broadcast
from canntrain_core.errors import RolloutEngineFailed
from canntrain_core.models.rollout import Rollout, layout
from canntrain_core.runtime.distributed import free_port

SERVER = Path(__file__).with_name("vllm_server.py")
REPO_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"  # what `make vllm-env` makes
VISIBLE_DEVICES = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass
class EngineSample:
    """One batch of prompts as the engine sampled it."""

    prompts: list  # (prompt ids, reference) pairs, as the data gave them
    rollout: Rollout
    logprobs: torch.Tensor  # [N, L - 1]: the engine's log p of each response token at its target position, 0 elsewhere
    version: int  # the step of the weights that sampled it
    seconds: float  # the engine's time on it


def find_vllm_python(explicit: str | None = None) -> str | None:
    """The vLLM environment's interpreter: ``explicit`` (``rlhf.rollout.python``), ``$CANNTRAIN_VLLM_PYTHON``, or the
    repository's ``.venv-vllm`` when there is one; None when none is named or made, or when
    ``CANNTRAIN_VLLM_PYTHON=off`` (what ``make test`` sets: it never runs vLLM, whether or not one was made)."""
    env = os.environ.get("CANNTRAIN_VLLM_PYTHON")
    if explicit or env == "off":
        return explicit
    return env or (str(REPO_VENV) if REPO_VENV.is_file() else None)


def vllm_python(cfg) -> str:
    """:func:`find_vllm_python` for ``rlhf.rollout``, or one line saying how to make one."""
    found = find_vllm_python(cfg.python)
    if not found:
        raise RolloutEngineFailed(
            "rlhf.rollout.backend vllm: no vLLM environment; `make vllm-env` makes .venv-vllm, or set "
            "rlhf.rollout.python (or $CANNTRAIN_VLLM_PYTHON) to its interpreter, or rlhf.rollout.url to a server"
        )
    if not Path(found).is_file():
        raise RolloutEngineFailed(f"rlhf.rollout.python: {found} does not exist (`make vllm-env` makes .venv-vllm)")
    return found


class VLLMEngine:
    """The trainer's handle on a vLLM rollout process: start or attach, sample, reload weights, stop."""

    def __init__(self, cfg, precision: str, run_dir: Path, device_type: str, rank: int, version: int):
        self.cfg, self.rank, self.proc = cfg, rank, None
        self.weights = Path(run_dir) / "rollout" / "weights"
        self.log_path = Path(run_dir) / "rollout" / "vllm.log"
        self.dtype = VLLM_DTYPES[precision] if cfg.dtype == "auto" else cfg.dtype
        self.device_type = device_type
        self.url = cfg.url.rstrip("/") if cfg.url else None
        self.version = version
        self.requests = ThreadPoolExecutor(1, thread_name_prefix="vllm-rollout")  # one at a time, in order
        self.group = None  # rank 0's weight-broadcast group with the engine's workers, once joined

    # ---- the process ----
    def start(self) -> None:
        """Rank 0 starts the server on the weights in ``self.weights`` (or checks the one at ``url``); every rank
        learns its address."""
        if self.rank == 0:
            if self.url is None:
                self._spawn()
            self._wait_ready()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            box = [self.url]
            dist.broadcast_object_list(box, src=0)
            self.url = box[0]

    def _spawn(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        c = self.cfg
        cmd = [vllm_python(c), str(SERVER), "--model", str(self.weights), "--port", str(port)]
        cmd += ["--version", str(self.version), "--dtype", self.dtype, "--parent-pid", str(os.getpid())]
        cmd += ["--tensor-parallel-size", str(c.tensor_parallel_size)]
        cmd += ["--gpu-memory-utilization", str(c.gpu_memory_utilization)]
        cmd += ["--max-model-len", str(c.max_model_len)] if c.max_model_len else []
        cmd += ["--enforce-eager"] if c.enforce_eager else []
        # On a CPU the engine shares the trainer's cores: vLLM's worker and engine-core processes busy-poll their
        # queues for a second after each request, and the trainer's next forward ran 15x slower (measured here)
        cmd += ["--single-process"] if self.device_type == "cpu" and c.tensor_parallel_size == 1 else []
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # canntrain's environment must not leak into vLLM's
        if c.kv_cache_gib:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(c.kv_cache_gib)))  # GiB, on a CPU
            cmd += ["--kv-cache-gib", str(c.kv_cache_gib)]
        if c.devices is not None and self.device_type in VISIBLE_DEVICES:
            env[VISIBLE_DEVICES[self.device_type]] = c.devices
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RolloutEngineFailed(
                    f"the vLLM rollout process (pid {self.proc.pid}) exited with code {self.proc.returncode} while "
                    f"starting on {self.weights}: {self._log_tail()}; its log is {self.log_path}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    self.version = json.load(r)["version"]
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        self.close()
        raise RolloutEngineFailed(
            f"the vLLM rollout server at {self.url} was not ready after rlhf.rollout.start_timeout_s="
            f"{self.cfg.start_timeout_s} s; its log is {self.log_path}"
        )

    def _log_tail(self) -> str:
        lines = self.log_path.read_text(errors="replace").strip().splitlines() if self.log_path.is_file() else []
        errors = [ln for ln in lines if "Error" in ln or "error" in ln]
        return (errors or lines or ["(no output)"])[-1].strip()

    def close(self) -> None:
        """Stop a server this run started (one it attached to keeps running)."""
        self.requests.shutdown(wait=False, cancel_futures=True)
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self._post("/shutdown", {}, timeout=10)
            self.proc.wait(timeout=30)
        except (RolloutEngineFailed, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)  # vLLM's engine core is a child process of its own
            self.proc.wait()

    # ---- requests ----
    def _post(self, path: str, body: dict, timeout: float | None = None) -> dict:
        req = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            detail = json.loads(e.read() or b"{}").get("error", "")
            raise RolloutEngineFailed(f"the vLLM rollout server at {self.url} refused {path}: {detail}") from e
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            raise RolloutEngineFailed(self._gone(path, e)) from e

    def _gone(self, path: str, e: BaseException) -> str:
        if self.proc is not None and self.proc.poll() is not None:
            what = f"the vLLM rollout process (pid {self.proc.pid}) exited with code {self.proc.returncode}"
        else:
            what = f"the vLLM rollout server at {self.url} stopped answering ({type(e).__name__})"
        return f"{what} during {path}; its log is {self.log_path}"

    def submit(
        self, prompts: list, n: int, max_new: int, temperature: float, top_k: int, eos_id: int, pad_id: int, seed: int
    ) -> Future:
        """Sample ``n`` responses to each prompt (in the background, after whatever was asked before): a Future of
        an :class:`EngineSample`."""
        body = {
            "prompts": [p for p, _ in prompts],
            "n": n,
            "max_tokens": max_new,
            "temperature": temperature,
            "top_k": top_k,
            "stop_token_ids": [eos_id],
            "seed": seed,
        }
        return self.requests.submit(self._generate, prompts, n, body, eos_id, pad_id)

    def _generate(self, prompts, n, body, eos_id, pad_id) -> EngineSample:
        out = self._post("/generate", body)
        expanded = [p for p, _ in prompts for _ in range(n)]
        ro = layout(expanded, out["tokens"], eos_id, pad_id)
        logprobs = torch.zeros_like(ro.mask)
        for i, (p, lp) in enumerate(zip(expanded, out["logprobs"])):
            logprobs[i, len(p) - 1 : len(p) - 1 + len(lp)] = torch.tensor(lp)
        return EngineSample(prompts, ro, logprobs, out["version"], out["seconds"])

    def load(self, version: int) -> float:
        """Rank 0: the engine reloads the weights just written, after every request sent before; the seconds it
        took."""
        out = self.requests.submit(self._post, "/load_weights", {"path": str(self.weights), "version": version})
        self.version = version
        return out.result()["seconds"]

    # ---- weights by broadcast ----
    def join_weight_group(self) -> None:
        """Rank 0: open the broadcast group with the engine's workers. The engine reaches this process at
        ``$MASTER_ADDR`` (127.0.0.1 when unset: an engine on this node)."""
        host, port, size = os.environ.get("MASTER_ADDR", "127.0.0.1"), free_port(), 1 + self.cfg.tensor_parallel_size
        timeout = self.cfg.start_timeout_s
        body = {"host": host, "port": port, "size": size, "timeout_s": timeout}
        joined = self.requests.submit(self._post, "/join_weights", body)
        opened: Future = Future()

        def open_mine() -> None:  # a thread: a group whose other end failed would block to its timeout
            try:
                opened.set_result(open_group(host, port, 0, size, self.device_type, timeout))
            except BaseException as e:
                opened.set_exception(e)

        threading.Thread(target=open_mine, daemon=True).start()
        while not opened.done():
            if joined.done() and joined.exception() is not None:
                raise joined.exception()
            time.sleep(0.05)
        self.group = opened.result()[0]
        joined.result()

    def send_weights(self, params: list, tensors, version: int) -> float:
        """Every rank: iterate ``tensors`` (a sharded model gathers each), rank 0 broadcasting each to the engine's
        workers, which load them as they arrive; then the prefix cache reset. ``params``: the (name, shape) list in
        the tensors' order. The seconds the engine took (rank 0)."""
        if self.rank != 0:
            for _ in tensors:
                pass
            return 0.0
        receiving = self.requests.submit(
            self._post, "/receive_weights", {"params": params, "dtype": self.dtype, "version": version}
        )
        try:
            for tensor in tensors:
                work = start_broadcast(self.group, tensor)
                while not work.is_completed():  # a receiver that failed would leave it pending to the timeout
                    if receiving.done() and receiving.exception() is not None:
                        raise receiving.exception()
                    time.sleep(0.001)
                work.wait()
        except RuntimeError as e:  # the other end of the group is gone
            raise RolloutEngineFailed(self._gone("/receive_weights", e)) from e
        self.version = version
        return receiving.result()["seconds"]
