"""Every bad input under tests/bad_inputs/ ends as one clear message, its exit code, and nothing written.

One file per case. Its first line says what `canntrain train CASE` must do:

    # expect: <exit code> | <fragment of the message on stderr>

(a YAML comment; binary and non-UTF-8 cases still start with this ASCII line, the bad bytes come
after it). A case that is a directory holds a file `expect` with that line. A case for another command
says which on its second line, with {case} for the case's path and {run} for a fresh output path:

    # args: export {case} -o {run}
 Files under
`bad_inputs/data/` are not cases: they are the corpora that the `bad_data_*` recipes point at,
by paths relative to bad_inputs/. Adding a case is adding a file.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from canntrain_core.cli import main
from conftest import BAD_INPUTS

CASES = BAD_INPUTS
_HEADER = re.compile(r"# expect: (\d+) \| (.+)")
_ARGS = re.compile(r"# args: (.+)")


def _cases() -> list[Path]:
    return sorted(p for p in CASES.iterdir() if p.name != "data" and not p.name.startswith("."))


def _expectation(case: Path) -> tuple[int, str, list[str] | None]:
    header_file = case / "expect" if case.is_dir() else case
    lines = header_file.read_bytes().split(b"\n", 2)
    first = lines[0].decode("ascii").rstrip("\r")
    m = _HEADER.fullmatch(first)
    assert m, f"{header_file}: first line must be '# expect: <exit code> | <message fragment>', got {first!r}"
    args = _ARGS.fullmatch(lines[1].decode("ascii", "replace").rstrip("\r")) if len(lines) > 1 else None
    return int(m.group(1)), m.group(2).strip(), args.group(1).split() if args else None


@pytest.mark.parametrize("case", _cases(), ids=lambda p: p.name)
def test_bad_input_is_one_clear_message(case, tmp_path, data_cache, monkeypatch, capfd):
    code, fragment, args = _expectation(case)
    monkeypatch.chdir(CASES)  # data cases name their corpora relative to bad_inputs/
    run = tmp_path / "run"
    before = {p: p.stat().st_mtime_ns for p in case.rglob("*")} if case.is_dir() else {}
    if args is None:
        args = ["train", case.name, "--run-dir", str(run), "--no-progress", "--set", f"data.cache_dir={data_cache}"]
    else:
        args = [a.replace("{case}", case.name).replace("{run}", str(run)) for a in args]
    rc = main(args)
    err = capfd.readouterr().err
    assert rc == code, err
    assert fragment in err
    assert err.startswith(f"canntrain {args[0]}: ") and "Traceback" not in err
    assert not run.exists()  # rejected before anything was written
    assert before == ({p: p.stat().st_mtime_ns for p in case.rglob("*")} if case.is_dir() else {})  # nor changed


def test_installed_command_rejects_a_duplicate_key(tmp_path, data_cache):
    exe = Path(sys.executable).with_name("canntrain")
    cmd = [str(exe)] if exe.is_file() else [sys.executable, "-m", "canntrain_core.cli"]
    run = tmp_path / "run"
    proc = subprocess.run(
        [
            *cmd,
            "train",
            "duplicate_key.yaml",
            "--run-dir",
            str(run),
            "--no-progress",
            "--set",
            f"data.cache_dir={data_cache}",
        ],
        cwd=CASES,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "canntrain train: invalid recipe:" in proc.stderr
    assert "duplicate_key.yaml, line 10: optim.lr: duplicate key (first at line 7)" in proc.stderr
    assert "Traceback" not in proc.stderr and not run.exists()
