"""Notebook kernels forked from one process that has already imported torch, transformers and canntrain.

The suite starts 22 IPython kernels (nbmake's notebooks, papermill's runs, those of ranks under
torchrun), and each pays about 5 CPU-seconds of imports before its first cell does any work: on two cores, a
minute of the suite's wall clock. Under ``make test`` (``--nbmake``) conftest starts one *zygote* that imports
them once and serves kernels by ``fork``, the way a forkserver serves ranks, and points Jupyter's ``python3``
kernelspec at a tiny client of it (``$JUPYTER_PATH``, searched before the installed spec):

    client (what Jupyter starts)  --unix socket: argv, env, cwd, stdio-->  zygote  --fork-->  ipykernel

The forked kernel is a real ipykernel running the notebook as a fresh one would: the environment, working
directory, argv, stdio and ``sys.path[0]`` of the client, its own session, fresh random seeds. The client stands in
for it towards Jupyter: it forwards signals (interrupt, terminate) to the kernel's process group and exits with the
kernel's code; killed, it takes the kernel with it (the zygote sees its socket close).

A kernel is forked only when nothing a fresh one would do differently happened in the zygote. Otherwise the client
runs ``python -m ipykernel_launcher`` itself, as the installed spec does, and the notebook runs as it always has:
- preloading printed a warning (a fresh kernel would show it in the notebook, where nbmake fails on it), or left a
  second thread (forking it would copy a pool that no longer exists);
- the client's environment differs from the zygote's in a variable read at import time (anything outside what
  Jupyter, pytest, torchrun and canntrain set per run: ``PER_RUN``);
- the zygote is not (yet) listening.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import threading
import traceback
import warnings

# Set per kernel by Jupyter, per test by pytest, per rank by torchrun, per run by canntrain, or by libraries at work in
# the worker: read when used, not at import, so a kernel forked from a zygote started without them behaves as one
# started with them.
PER_RUN_PREFIXES = ("JPY_", "PYTEST_", "PYDEVD_", "CANNTRAIN_", "TORCHELASTIC_")
PER_RUN = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "CUDA_MODULE_LOADING",
    "COLUMNS",  # pytest's terminal size, without workers
    "LINES",
    # set in the workers by what their tests import or run (lm_eval's and scikit-learn's imports, inductor's C++
    # builder, wandb's service), and read when used (a download, a compile, a tracker)
    "HF_XET_HIGH_PERFORMANCE",
    "KMP_DUPLICATE_LIB_OK",
    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
    "WANDB_SERVICE",
}
# What every notebook imports first (about 5 CPU-s): the stage table pulls in torch, transformers and the models.
# Not matplotlib: it reads $MPLBACKEND on import, which ipykernel sets in the kernel (its inline backend).
PRELOAD = ("canntrain_core.stages", "canntrain_core.jobs.alignment_start", "ipykernel.kernelapp")
_HEADER = struct.Struct("!I")
FOLDER_PREFIX = "canntrain-kernels-"  # a session's folder: its kernelspec and the zygote's socket


def socket_in(folder: str) -> str:
    """The zygote's socket in the session's folder."""
    return os.path.join(folder, "zygote.sock")


def session_folder() -> str | None:
    """The folder of this session's forked kernels, on $JUPYTER_PATH (None when kernels are not forked)."""
    return next((p for p in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if FOLDER_PREFIX in p), None)


def kernelspec(folder: str, socket_path: str) -> None:
    """Write ``folder/kernels/python3/kernel.json``: Jupyter's ``python3`` kernel, started through this client."""
    spec = os.path.join(folder, "kernels", "python3")
    os.makedirs(spec, exist_ok=True)
    argv = [sys.executable, os.path.abspath(__file__), "connect", socket_path, "-f", "{connection_file}"]
    with open(os.path.join(spec, "kernel.json"), "w") as f:
        json.dump({"argv": argv, "display_name": "Python 3 (ipykernel)", "language": "python"}, f)


def _differs(env: dict, start: dict, preloaded: dict) -> list[str]:
    """The variables in which ``env`` (a client's) differs from ``start`` (the zygote's before it imported) and
    that a fresh kernel may read at import. One the imports set themselves (``preloaded``: canntrain's
    HF_HUB_OFFLINE, inductor's cache directory) may also have the value they set."""
    names = {k for k in set(env) | set(start) if env.get(k) != start.get(k)}
    names = {n for n in names if n not in PER_RUN and not n.startswith(PER_RUN_PREFIXES)}
    return sorted(n for n in names if not (n in preloaded and env.get(n) == preloaded[n]))


# ------------------------------------------------------------------------------------------------------ the client
def connect(socket_path: str, kernel_argv: list[str]) -> None:
    """Ask the zygote for a kernel; stand in for it until it exits. Without a zygote: become a fresh kernel."""
    fresh = [sys.executable, "-m", "ipykernel_launcher", *kernel_argv]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(socket_path)
        payload = json.dumps({"argv": kernel_argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        socket.send_fds(sock, [_HEADER.pack(len(payload))], [0, 1, 2])
        sock.sendall(payload)
        reply = sock.makefile("r")
        pid = int(reply.readline() or 0)
    except (OSError, ValueError):
        pid = 0
    if not pid:  # no zygote, or it declined this kernel
        os.execv(sys.executable, fresh)

    def forward(signum, _frame):
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, forward)
    line = reply.readline()  # the kernel's exit code, when the zygote reaps it
    sys.exit(int(line) if line.strip() else 1)


# ------------------------------------------------------------------------------------------------------ the zygote
def _preload() -> str:
    """Import PRELOAD; why kernels must not be forked from this process ('' when they may)."""
    with warnings.catch_warnings(record=True) as shown:  # the filters a fresh process has: what it would print
        for name in PRELOAD:
            __import__(name)
    if shown:
        return f"importing {', '.join(PRELOAD)} printed {shown[0].category.__name__}: {shown[0].message}"
    if not os.path.isdir("/proc/self/task"):
        return "this system has no /proc to count the threads in"
    threads = len(os.listdir("/proc/self/task"))
    if threading.active_count() > 1 or threads > 1:
        return f"importing {', '.join(PRELOAD)} left {threads} threads (set OMP_NUM_THREADS=1)"
    return ""


def _become_kernel(request: dict, fds: list[int], preloaded: dict) -> None:
    """In the forked child: take the client's stdio, session, environment (with what the imports set in it, as in a
    fresh kernel), directory and argv; run ipykernel."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update({**preloaded, **request["env"]})
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # what ``python -m ipykernel_launcher`` puts first
        sys.argv = [importlib.util.find_spec("ipykernel_launcher").origin, *request["argv"]]
        if os.environ.get("JPY_PARENT_PID"):  # the one JPY_ variable ipykernel reads on import (a trait's default)
            sys.argv.append(f"--IPKernelApp.parent_handle={os.environ['JPY_PARENT_PID']}")
        # deferred: the client runs this file too and must start in milliseconds; here they are preloaded already
        import numpy
        import torch
        from ipykernel import kernelapp

        random.seed()  # the zygote's state, copied into every kernel, would make them draw the same numbers
        numpy.random.seed()
        torch.seed()

        kernelapp.launch_new_instance()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(socket_path: str) -> None:
    """Preload, then fork a kernel for each client until SIGTERM; each client hears its kernel's pid, then its
    exit code. A client that goes away takes its kernel with it."""
    start = dict(os.environ)
    why_not = _preload()
    preloaded = {k: v for k, v in os.environ.items() if start.get(k) != v}
    if why_not:
        print(f"forked kernels: off, {why_not}; each kernel imports its own", file=sys.stderr)
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".tmp")
    listener.listen(64)
    os.rename(socket_path + ".tmp", socket_path)  # clients that come earlier start fresh kernels
    kernels: dict[int, socket.socket] = {}
    served = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    parent = os.getppid()
    try:
        while os.getppid() == parent:  # the session that started it ended without stopping it: stop too
            ready, _, _ = select.select([listener, *kernels.values()], [], [], 0.2)
            for sock in ready:
                if sock is listener:
                    served.append(_accept(listener, kernels, start, preloaded))
                else:  # the client is gone (killed): so is its kernel
                    pid = next(p for p, s in kernels.items() if s is sock)
                    _kill(pid)
                    kernels.pop(pid).close()
            _reap(kernels)
    finally:
        for pid in kernels:
            _kill(pid)
        os.unlink(socket_path)
        print(f"forked kernels: {sum(served)} forked, {len(served) - sum(served)} fresh", file=sys.stderr)


def _accept(listener: socket.socket, kernels: dict, start: dict, preloaded: dict) -> bool:
    """Fork a kernel for the client waiting on ``listener``; whether it was forked."""
    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
        (size,) = _HEADER.unpack(header)
        data = b""
        while len(data) < size:
            chunk = conn.recv(size - len(data))
            if not chunk:
                raise OSError("the client left mid-request")
            data += chunk
        request = json.loads(data)
    except (OSError, ValueError, struct.error):
        for fd in fds:
            os.close(fd)
        conn.close()
        return False
    differs = _differs(request["env"], start, preloaded)
    if differs or len(fds) != 3:
        why = f"its environment differs in {', '.join(differs)}" if differs else "it sent no stdin, stdout and stderr"
        print(f"forked kernels: a fresh kernel, {why}", file=sys.stderr)
        for fd in fds:
            os.close(fd)
        conn.sendall(b"0\n")
        conn.close()
        return False
    pid = os.fork()
    if pid == 0:
        listener.close()
        conn.close()
        for sock in kernels.values():
            sock.close()
        _become_kernel(request, fds, preloaded)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    kernels[pid] = conn
    return True


def _reap(kernels: dict) -> None:
    """Collect every kernel that has exited (those whose clients went too among them); tell the waiting clients."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        conn = kernels.pop(pid, None)
        if conn is not None:
            code = os.waitstatus_to_exitcode(status)
            try:
                conn.sendall(f"{code if code >= 0 else 128 - code}\n".encode())
            except OSError:
                pass
            conn.close()


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        connect(sys.argv[2], sys.argv[3:])
