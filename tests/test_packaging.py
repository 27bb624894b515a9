"""Packaging promises: conda and pip agree, and our kernels package does not shadow the hub `kernels`."""

import re
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
    assert make.index('pip install -q "$(TORCH)"') < make.index('pip install -q -e ".[dev]"')


def test_our_kernels_package_does_not_shadow_the_hub_kernels_package():
    # transformers (5.x) imports the hub's `kernels` library when it is installed; our fused kernels
    # once lived in a top-level `kernels` package and broke that import. They are canntrain_kernels now.
    import importlib.util

    spec = importlib.util.find_spec("kernels")
    assert spec is None or "site-packages" in Path(spec.origin).parts
    from transformers import LlamaForCausalLM  # noqa: F401  (imports hub_kernels -> kernels)


def test_no_module_imports_another_modules_private_names():
    """A name with a leading underscore belongs to its module (import-linter cannot say so; this does)."""
    import ast

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
