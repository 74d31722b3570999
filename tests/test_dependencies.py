"""Every third-party module omniweave imports when a module loads is a declared runtime dependency.

A GPU user installs omniweave with pip into a fresh venv: only ``[project] dependencies`` come with
it. A module-level import of a package that only the dev venv has (it arrived there through trl or
datasets) works in our tests and aborts the user's ``omniweave`` command -- CI's CUDA-build leg
caught ``pyarrow`` that way. Optional packages (flash-attn, fla, vLLM, peft, torchvision) may only be
imported inside functions, where their absence is a clear error for the one feature that needs them.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# import name -> distribution name, where the two differ
DISTRIBUTION = {"PIL": "pillow", "yaml": "pyyaml", "hydra": "hydra-core"}
OPTIONAL = {"flash_attn", "fla", "vllm", "peft", "torchvision"}


def declared_runtime() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower() for req in project["dependencies"]}


def module_level_imports(path: Path) -> set[str]:
    """Top-level names imported by statements that run when the module loads (not in functions)."""
    names: set[str] = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
            elif isinstance(node, ast.ClassDef):
                visit(node.body)

    visit(ast.parse(path.read_text()).body)
    return names


def test_module_level_imports_are_runtime_dependencies():
    declared = declared_runtime()
    undeclared = {}
    for path in sorted((ROOT / "omniweave").rglob("*.py")):
        for name in module_level_imports(path):
            if name in sys.stdlib_module_names or name in ("omniweave", "__future__"):
                continue
            if DISTRIBUTION.get(name, name).lower() not in declared:
                undeclared.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not undeclared, f"imported at module level but not in [project] dependencies: {undeclared}"


def test_optional_packages_are_not_runtime_dependencies():
    """The optional ones stay optional: a declared dependency would make every user install them."""
    assert not OPTIONAL & {DISTRIBUTION.get(n, n) for n in declared_runtime()}


def test_the_check_sees_an_undeclared_module_level_import(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import os\nimport pyarrow.parquet as pq\ntry:\n    import fla\nexcept ImportError:\n"
                      "    fla = None\ndef f():\n    import vllm\n")
    assert module_level_imports(source) == {"os", "pyarrow", "fla"}
