"""Packaging promises: conda and pip agree, our kernels package does not shadow the hub `kernels`, and library code
imports at the top (or says why not)."""

import ast
import os
import re
import subprocess
import sys
import tokenize
import tomllib
from pathlib import Path

import yaml
from conftest import ROOT


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_name(r): r for r in project["dependencies"] + project["optional-dependencies"]["dev"]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_list = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    got = {_name(r): r for r in pip_list if not r.startswith("-e")}
    assert set(got) == set(wanted)
    for name, req in got.items():
        if name == "torch":  # conda pins the exact build the Makefile installs; pyproject holds the range
            assert req == "torch==2.13.0"
        else:
            assert req.replace(" ", "") == wanted[name].replace(" ", ""), name


def test_makefile_installs_pinned_torch_first():
    make = (ROOT / "Makefile").read_text()
    assert "TORCH  ?= torch==2.13.0" in make
    # torch through pip (the wheel pip is configured to see), then the project through uv or pip, which keep it
    assert make.index('pip install -q --no-compile "$(TORCH)"') < make.index('$(PIP_REST) -e ".[dev]"')


def test_our_kernels_package_does_not_shadow_the_hub_kernels_package():
    # transformers (5.x) imports the hub's `kernels` library when it is installed; our fused kernels
    # once lived in a top-level `kernels` package and broke that import. They are canntrain_kernels now.
    import importlib.util

    spec = importlib.util.find_spec("kernels")
    assert spec is None or "site-packages" in Path(spec.origin).parts
    from transformers import LlamaForCausalLM  # noqa: F401  (imports hub_kernels -> kernels)


def test_no_module_imports_another_modules_private_names():
    """A name with a leading underscore belongs to its module (import-linter cannot say so; this does)."""
    found = []
    for package in ("canntrain_core", "canntrain_kernels"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    ("canntrain_core", "canntrain_kernels")
                ):
                    private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                    found += [f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{n}" for n in private]
    assert not found, found


def test_function_level_imports_say_why_they_are_deferred():
    """Library code imports at the top; an import inside a function is there for start-up time (``canntrain --help``
    imports every command's module), an optional dependency, or an import cycle, and says which in a ``# deferred:``
    comment on its line or just above its run of consecutive imports."""
    found = []
    for package in ("canntrain_core", "canntrain_kernels"):
        for path in sorted((ROOT / package).rglob("*.py")):
            with tokenize.open(path) as f:
                comments = {
                    t.start[0]: t.string for t in tokenize.generate_tokens(f.readline) if t.type == tokenize.COMMENT
                }
            tree = ast.parse(path.read_text(), str(path))
            imports = set()
            for fn in ast.walk(tree):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    imports |= {n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
            import_lines = {line for n in imports for line in range(n.lineno, n.end_lineno + 1)}
            for node in sorted(imports, key=lambda n: n.lineno):
                own = any("# deferred:" in comments.get(i, "") for i in range(node.lineno, node.end_lineno + 1))
                above = node.lineno - 1
                while above in import_lines:  # the run of consecutive imports this one ends
                    above -= 1
                if not own and not comments.get(above, "").startswith("# deferred:"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "function-level imports without a '# deferred: <why>' comment:\n" + "\n".join(found)


def test_the_command_lines_help_imports_no_stage_transformers_or_data_path():
    """``canntrain --help`` imports every command's module (``cli.COMMANDS``): each loads what its command runs only
    when it runs, so the help takes torch's import (the kernels' op names), not the stages' (5.2 s here before, 1.7 s).
    """
    probe = (
        "import sys; from canntrain_core.cli import build_parser; build_parser([]); "
        "print(' '.join(m for m in ('transformers', 'canntrain_core.stages', 'canntrain_core.data.prepare', "
        "'canntrain_core.checkpoint', 'lm_eval') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""


def test_importing_canntrain_puts_the_hub_offline_before_huggingface_hub_reads_it():
    """huggingface_hub reads HF_HUB_OFFLINE once, at its import: canntrain sets it first (models/hf.py used to set it
    after transformers had imported the hub, which left it online); a user's own value wins."""
    probe = "import canntrain_core.models.hf, huggingface_hub.constants as c; print(c.HF_HUB_OFFLINE)"
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split()[-1] == "True"
    out = subprocess.run(
        [sys.executable, "-c", probe], env={**env, "HF_HUB_OFFLINE": "0"}, capture_output=True, text=True, check=True
    ).stdout
    assert out.split()[-1] == "False"
