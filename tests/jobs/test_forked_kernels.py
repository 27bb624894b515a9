"""The suite's notebook kernels, forked from one preloaded process (tests/forked_kernels.py), start as a fresh
kernel would: the client's directory, first path entry, environment and matplotlib backend, their own random state;
a client whose environment differs in what a fresh kernel reads at import gets a fresh kernel. multiprocessing's
forkservers are forked from it too, and its other processes run in the real interpreter."""

import json
import os
import subprocess
import sys
import time

import pytest
from jupyter_client.manager import start_new_kernel

from forked_kernels import interpreter_in, session_folder, socket_in

PROBE = """
import json, os, random, sys
print(json.dumps({"parent": open(f"/proc/{os.getppid()}/cmdline").read().replace(chr(0), " "), "cwd": os.getcwd(),
                  "path0": sys.path[0], "probe": os.environ.get("CANNTRAIN_PROBE"), "mpl": os.environ.get("MPLBACKEND"),
                  "torch": "torch" in sys.modules, "random": random.random()}))
"""

pytestmark = pytest.mark.skipif(session_folder() is None, reason="kernels are forked under --nbmake only")


@pytest.fixture(scope="module", autouse=True)
def zygote_listening():
    """The session's zygote imports for a few seconds after the session starts; clients before that start fresh."""
    socket_path = socket_in(session_folder())
    deadline = time.monotonic() + 120
    while not os.path.exists(socket_path) and time.monotonic() < deadline:
        time.sleep(0.2)


def _run_kernel(cwd, **env) -> dict:
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(cwd), env={**os.environ, **env})
    printed = []
    try:
        kc.execute_interactive(PROBE, timeout=60, output_hook=lambda m: printed.append(m["content"].get("text", "")))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return json.loads("".join(printed))


def test_a_forked_kernel_starts_as_a_fresh_one_would(tmp_path):
    first = _run_kernel(tmp_path, CANNTRAIN_PROBE="one")
    second = _run_kernel(tmp_path, CANNTRAIN_PROBE="two")
    for seen, probe in ((first, "one"), (second, "two")):
        assert "forked_kernels.py serve" in seen["parent"]  # forked by the session's zygote
        assert seen["torch"]  # imported before the first cell
        assert seen["cwd"] == seen["path0"] == str(tmp_path) and seen["probe"] == probe
        assert seen["mpl"] == "module://matplotlib_inline.backend_inline"  # ipykernel's, as in a fresh kernel
    assert first["random"] != second["random"]  # reseeded, not the zygote's state copied


def test_a_client_whose_environment_differs_at_import_gets_a_fresh_kernel(tmp_path):
    seen = _run_kernel(tmp_path, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    assert "forked_kernels.py serve" not in seen["parent"] and not seen["torch"]
    assert seen["cwd"] == seen["path0"] == str(tmp_path)


# multiprocessing in a process of the session: a child started the given way reports what it was started from
MULTIPROCESSING = """
import json, multiprocessing, os, sys


def probe(queue):
    queue.put({"parent": open(f"/proc/{os.getppid()}/cmdline").read().replace(chr(0), " "), "cwd": os.getcwd(),
               "torch": "torch" in sys.modules, "probe": os.environ.get("CANNTRAIN_PROBE")})


if __name__ == "__main__":
    multiprocessing.set_executable(sys.argv[1])
    ctx = multiprocessing.get_context(sys.argv[2])
    queue = ctx.SimpleQueue()
    child = ctx.Process(target=probe, args=(queue,))
    child.start()
    print(json.dumps(queue.get()))
    child.join()
    sys.exit(child.exitcode)
"""


def _multiprocessing_child(tmp_path, method: str, **env) -> dict:
    if not os.path.exists(interpreter_in(session_folder())):
        pytest.skip("the interpreter's path is too long for a script's #! line: forkservers start as usual")
    script = tmp_path / "start.py"
    script.write_text(MULTIPROCESSING)
    env = {**os.environ, "CANNTRAIN_PROBE": method, **env}
    done = subprocess.run(
        [sys.executable, str(script), interpreter_in(session_folder()), method],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_forkserver_is_forked_from_the_zygote_and_other_children_run_the_real_interpreter(tmp_path):
    forked = _multiprocessing_child(tmp_path, "forkserver")
    assert "forked_kernels.py serve" in forked["parent"]  # its forkserver is the zygote's child, not an interpreter
    assert forked["torch"] and forked["probe"] == "forkserver" and forked["cwd"] == str(tmp_path)
    spawned = _multiprocessing_child(tmp_path, "spawn")
    assert "start.py" in spawned["parent"] and not spawned["torch"]  # a fresh interpreter of its own
    assert spawned["probe"] == "spawn" and spawned["cwd"] == str(tmp_path)


def test_a_forkserver_the_zygote_declines_runs_in_the_real_interpreter_with_its_descriptors(tmp_path):
    """A request declined (here: another PYTHONPATH, which a fresh interpreter reads at start) execs the interpreter
    with the listener and alive pipe multiprocessing passed still open: the forkserver serves its child as usual."""
    seen = _multiprocessing_child(
        tmp_path, "forkserver", PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    )
    assert "forked_kernels.py" not in seen["parent"] and "multiprocessing.forkserver import main" in seen["parent"]
    assert not seen["torch"] and seen["probe"] == "forkserver" and seen["cwd"] == str(tmp_path)
