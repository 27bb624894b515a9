"""Notebook kernels forked from one process that has already imported torch, transformers and canntrain.

The suite starts about two dozen IPython kernels (nbmake's notebooks, papermill's runs, those of ranks under
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

The same zygote serves multiprocessing's forkservers, which :mod:`canntrain_core.jobs.local_ranks` starts to fork
ranks from (one per notebook kernel that launches ranks and one per worker: a fresh interpreter importing the same
stack, about 5 CPU-s each). multiprocessing starts its forkserver as ``EXECUTABLE -B -c "from
multiprocessing.forkserver import main; main(LISTENER_FD, ALIVE_FD, PRELOAD, ...)"`` with those two descriptors
passed; in the kernels and the workers EXECUTABLE is this session's ``python`` script, a client that sends them to
the zygote, whose child takes them at the same numbers and runs that command. Anything else the script is asked to
run (a spawned process, the resource tracker) execs the real interpreter, as do requests the zygote declines.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import multiprocessing
import multiprocessing.util
import os
import random
import re
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
    # set by ipykernel in every kernel (its shell's terminal and pager, its inline matplotlib backend), and so in the
    # environment a kernel's forkserver is started with; read when a terminal, pager or matplotlib is used
    "TERM",
    "CLICOLOR",
    "CLICOLOR_FORCE",
    "FORCE_COLOR",
    "PAGER",
    "GIT_PAGER",
    "MPLBACKEND",
}
# What every notebook imports first (about 5 CPU-s): the stage table pulls in torch, transformers and the models.
# Not matplotlib: it reads $MPLBACKEND on import, which ipykernel sets in the kernel (its inline backend).
PRELOAD = ("canntrain_core.stages", "canntrain_core.jobs.alignment_start", "ipykernel.kernelapp")
_HEADER = struct.Struct("!I")
# the command multiprocessing.forkserver.ForkServer.ensure_running gives the interpreter it starts
_FORKSERVER = re.compile(r"from multiprocessing\.forkserver import main; main\((?P<listener>\d+), (?P<alive>\d+), ")
FOLDER_PREFIX = "canntrain-kernels-"  # a session's folder: its kernelspec and the zygote's socket


def socket_in(folder: str) -> str:
    """The zygote's socket in the session's folder."""
    return os.path.join(folder, "zygote.sock")


def session_folder() -> str | None:
    """The folder of this session's forked kernels, on $JUPYTER_PATH (None when kernels are not forked)."""
    return next((p for p in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if FOLDER_PREFIX in p), None)


def interpreter_in(folder: str) -> str:
    """The session's ``python`` script: multiprocessing's executable in the kernels and the workers."""
    return os.path.join(folder, "python")


def kernelspec(folder: str, socket_path: str) -> None:
    """Write ``folder/kernels/python3/kernel.json``: Jupyter's ``python3`` kernel, started through this client;
    and ``folder/python``, an interpreter whose forkservers are forked by the zygote (the rest it runs itself)."""
    spec = os.path.join(folder, "kernels", "python3")
    os.makedirs(spec, exist_ok=True)
    argv = [sys.executable, os.path.abspath(__file__), "connect", socket_path, "-f", "{connection_file}"]
    with open(os.path.join(spec, "kernel.json"), "w") as f:
        json.dump({"argv": argv, "display_name": "Python 3 (ipykernel)", "language": "python"}, f)
    shebang = f"#!{sys.executable}\n"  # Python itself, not a shell: a shell would set $PWD, which the zygote compares
    if len(shebang) > 127:  # what older kernels read of the line: forkservers then start as usual
        return
    script = interpreter_in(folder)
    with open(script, "w") as f:
        f.write(
            f"{shebang}import sys\nsys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
            f"import forked_kernels\nforked_kernels.python({socket_path!r}, sys.argv[1:])\n"
        )
    os.chmod(script, 0o755)


def use_interpreter(folder: str) -> None:
    """Have multiprocessing start its processes through the session's ``python`` script, where there is one."""
    if os.path.exists(interpreter_in(folder)):
        multiprocessing.set_executable(interpreter_in(folder))


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
    _stand_in(socket_path, {"kind": "kernel", "argv": kernel_argv}, [0, 1, 2])
    os.execv(sys.executable, [sys.executable, "-m", "ipykernel_launcher", *kernel_argv])  # no zygote, or declined


def python(socket_path: str, args: list[str]) -> None:
    """``python ARGS``: a forkserver forked by the zygote when ARGS start one; any other command, or a declined
    request, runs in the real interpreter (the passed descriptors stay open across the exec)."""
    at = args.index("-c") if "-c" in args[:-1] else None  # the interpreter's flags come before it, the command after
    match = _FORKSERVER.match(args[at + 1]) if at is not None else None
    if match:
        targets = [0, 1, 2, int(match["listener"]), int(match["alive"])]
        request = {"kind": "forkserver", "flags": args[:at], "command": args[at + 1], "fds": targets}
        _stand_in(socket_path, request, targets)
    os.execv(sys.executable, [sys.executable, *args])


def _stand_in(socket_path: str, request: dict, fds: list[int]) -> None:
    """Send ``request`` (with this process's environment and directory) and ``fds``; when the zygote forks for it,
    stand in for the child until it exits, then exit with its code. Returns when there is no zygote or it declines."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(socket_path)
        payload = json.dumps({**request, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        socket.send_fds(sock, [_HEADER.pack(len(payload))], fds)
        sock.sendall(payload)
        reply = sock.makefile("r")
        pid = int(reply.readline() or 0)
    except (OSError, ValueError):
        pid = 0
    if not pid:
        sock.close()
        return
    for fd in fds[3:]:  # the child holds them now
        os.close(fd)

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


def _take_client(request: dict, fds: list[int]) -> None:
    """In a forked child: the client's descriptors at its numbers, a session of its own, the client's environment
    (with what the imports set in it, as in a fresh process), directory, and fresh random states."""
    targets = request.get("fds", range(len(fds)))
    # above every target first: a target may be the number a received descriptor came in at
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, max(targets) + 1) for fd in fds]
    for fd in fds:
        os.close(fd)
    for target, fd in zip(targets, moved):
        os.dup2(fd, target)
        os.close(fd)
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    # deferred: the client runs this file too and must start in milliseconds; here they are preloaded already
    import numpy
    import torch

    random.seed()  # the zygote's state, copied into every child, would make them draw the same numbers
    numpy.random.seed()
    torch.seed()


def _become(request: dict, fds: list[int], preloaded: dict) -> None:
    """In the forked child: take the client's place and run what it asked for, ipykernel or a forkserver."""
    code = 1
    try:
        _take_client({**request, "env": {**preloaded, **request["env"]}}, fds)
        if request["kind"] == "forkserver":
            sys.argv = ["-c"]
            sys.path[0] = ""  # what ``python -c`` puts first
            exec(request["command"], {"__name__": "__main__"})
        else:
            sys.path[0] = request["cwd"]  # what ``python -m ipykernel_launcher`` puts first
            sys.argv = [importlib.util.find_spec("ipykernel_launcher").origin, *request["argv"]]
            if os.environ.get("JPY_PARENT_PID"):  # the one JPY_ variable ipykernel reads on import (a trait's default)
                sys.argv.append(f"--IPKernelApp.parent_handle={os.environ['JPY_PARENT_PID']}")
            from ipykernel import kernelapp  # deferred, as above

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
    use_interpreter(os.path.dirname(socket_path))  # the kernels' forkservers (local ranks) come here too
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".tmp")
    listener.listen(64)
    os.rename(socket_path + ".tmp", socket_path)  # clients that come earlier start fresh kernels
    kernels: dict[int, socket.socket] = {}
    served = {"kernel": [0, 0], "forkserver": [0, 0]}  # forked, fresh
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    parent = os.getppid()
    try:
        while os.getppid() == parent:  # the session that started it ended without stopping it: stop too
            ready, _, _ = select.select([listener, *kernels.values()], [], [], 0.2)
            for sock in ready:
                if sock is listener:
                    kind, forked = _accept(listener, kernels, start, preloaded)
                    served[kind][not forked] += 1
                else:  # the client is gone (killed): so is its kernel
                    pid = next(p for p, s in kernels.items() if s is sock)
                    _kill(pid)
                    kernels.pop(pid).close()
            _reap(kernels)
    finally:
        for pid in kernels:
            _kill(pid)
        os.unlink(socket_path)
        counts = "; ".join(f"{kind}s: {n} forked, {fresh} fresh" for kind, (n, fresh) in served.items())
        print(f"forked kernels: {counts}", file=sys.stderr)


def _accept(listener: socket.socket, kernels: dict, start: dict, preloaded: dict) -> tuple[str, bool]:
    """Fork a kernel or a forkserver for the client waiting on ``listener``; which it asked for, whether forked."""
    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 5)
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
        return "kernel", False
    kind = "forkserver" if request.get("kind") == "forkserver" else "kernel"
    ours = {listener.fileno(), conn.fileno(), *fds, *(sock.fileno() for sock in kernels.values())}
    why = _declined(request, fds, _differs(request["env"], start, preloaded), ours)
    if why:
        print(f"forked kernels: a fresh {kind}, {why}", file=sys.stderr)
        for fd in fds:
            os.close(fd)
        conn.sendall(b"0\n")
        conn.close()
        return kind, False
    pid = os.fork()
    if pid == 0:
        listener.close()
        conn.close()
        for sock in kernels.values():
            sock.close()
        _become(request, fds, preloaded)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    kernels[pid] = conn
    return kind, True


def _declined(request: dict, fds: list[int], differs: list[str], ours: set[int]) -> str:
    """Why the zygote must not fork for ``request`` ('' when it may)."""
    if differs:
        return f"its environment differs in {', '.join(differs)}"
    if request.get("kind") == "kernel":
        return "" if len(fds) == 3 else "it sent no stdin, stdout and stderr"
    if request.get("kind") != "forkserver" or len(fds) != 5 or len(request.get("fds", ())) != 5:
        return "its request is not a kernel's or a forkserver's"
    if request["flags"] != multiprocessing.util._args_from_interpreter_flags():
        return f"its interpreter flags {request['flags']} are not the zygote's"
    taken = [fd for fd in request["fds"][3:] if fd not in ours and _is_open(fd)]
    return f"descriptors {taken} are in use here" if taken else ""


def _is_open(fd: int) -> bool:
    """Whether ``fd`` is open in this process (without opening one, as listing /proc/self/fd would)."""
    try:
        os.fstat(fd)
    except OSError:
        return False
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
    elif sys.argv[1] == "python":
        python(sys.argv[2], sys.argv[3:])
    else:
        connect(sys.argv[2], sys.argv[3:])
