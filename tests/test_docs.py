"""The docs are tested like code (issue 15): a doc example that breaks fails CI.

- every shell block of README.md and docs/*.md runs, scaled down (tests/docs_blocks.py says how
  and how a block opts out with a reason), in a fresh workspace holding a small demo dataset
  where `make demo` would have left it (runs/demo/{data,raw,packed});
- every omniweave flag and recipe key the docs mention (in a shell block or inline) exists;
- the recipe-key table of docs/training.md is exactly the recipe schema, defaults included.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from docs_blocks import DOCS, REPO, logical_lines, omniweave_commands, python_scripts, scale, shell_blocks
from omniweave.config import schema_defaults

# ---------------------------------------------------------------------------- what exists

EXTERNAL_FLAGS = {  # flags of other tools the docs show (torchrun, pip, pytest, make, sbatch)
    "--nproc-per-node", "--nnodes", "--rdzv-backend", "--rdzv-endpoint", "--standalone", "--parsable",
    "--dependency", "--cpus-per-task", "--wrap", "--export", "--job-name", "--array", "--logdir", "--help",
}


def omniweave_options() -> dict[str, set[str]]:
    """'group cmd' -> the option strings of its parser."""
    import argparse
    import importlib

    from omniweave.cli import COMMANDS

    out = {}
    for (group, cmd), (module, _) in COMMANDS.items():
        p = argparse.ArgumentParser()
        importlib.import_module(module).add_arguments(p)
        out[group if cmd is None else f"{group} {cmd}"] = {o for a in p._actions for o in a.option_strings} | {"--debug"}
    return out


def script_options(path: Path) -> set[str]:
    return set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", path.read_text())) | {"--help"}


def model_keys() -> set[str]:
    """``model.<kind>.<key>``: the keys of the shipped component YAMLs and every field of the
    registered components' config dataclasses (a key a YAML leaves at its default is still valid)."""
    import dataclasses

    from omniweave.models import registry

    keys = set()
    for f in (REPO / "omniweave/configs/models").glob("*/*.yaml"):
        keys |= {f"model.{f.parent.name}.{k}" for k in (yaml.safe_load(f.read_text()) or {})}
    from omniweave.models.lora import LORA_KEYS

    for kind in registry.MODEL_SECTIONS:  # keys every component takes (lora: models/lora.py)
        keys |= {f"model.{kind}.{k}" for k in registry.COMMON_KEYS} | {f"model.{kind}.lora.{k}" for k in LORA_KEYS}
    for kind in ("foundation", "image_encoder", "projector", "action_expert"):
        for name in registry.names(kind):
            config_cls = registry.lookup(kind, name)[1]
            if config_cls is not None:
                keys |= {f"model.{kind}.{fld.name}" for fld in dataclasses.fields(config_cls)}
    return keys


def valid_key(key: str, schema: set[str], models: set[str]) -> bool:
    if key in schema or key in models or any(k.startswith(key + ".") for k in schema | models):
        return True
    if "@" in key:  # a component swap: group@package=option
        return (REPO / "omniweave/configs/models" / key.split("@")[0]).is_dir()
    return False


def _placeholder(word: str) -> bool:
    return bool(re.search(r"[A-Z]{2,}|…|\.\.\.", word)) or word.split("=")[0] in ("key", "k")


# ---------------------------------------------------------------------------- flags and keys


def test_every_omniweave_flag_and_recipe_key_in_the_docs_exists():
    options = omniweave_options()
    schema = set(schema_defaults())
    models = model_keys()
    problems = []
    for doc in DOCS:
        text = doc.read_text()
        commands = [(b.where(), words) for b in shell_blocks(doc) for words in omniweave_commands(b)]
        commands += [(f"{doc.relative_to(REPO)} (inline)", span.split())
                     for span in re.findall(r"`(omniweave [^`]+)`", text)]
        for where, words in commands:
            name = " ".join(words[1:3]) if " ".join(words[1:3]) in options else words[1] if len(words) > 1 else ""
            if name not in options:
                problems.append(f"{where}: unknown command {' '.join(words[:3])!r}")
                continue
            for word in words[1:]:
                word = word.strip("[]|,")
                if word.startswith("--") and word.split("=")[0] not in options[name]:
                    problems.append(f"{where}: `omniweave {name}` has no flag {word}")
                elif "=" in word and not word.startswith("-") and not _placeholder(word):
                    key = word.split("=")[0].lstrip("+")
                    if not valid_key(key, schema, models):
                        problems.append(f"{where}: unknown recipe key {key!r}")
        # recipe keys named in prose: `data.x`, `train.x`, … and `model.<kind>.<key>`
        # (``model.X`` alone is also Python / HF naming: only ``model.<component>.…`` is a recipe key)
        pattern = r"`((?:data|train|eval|parallel|demo)\.[a-z_0-9.]+|model\.(?:image_encoder|projector|foundation)[a-z_0-9.]*)"
        for key in re.findall(pattern, text):
            key = key.rstrip(".")
            if re.search(r"\.(py|md|yaml|json|jsonl)$", key):
                continue
            if not valid_key(key, schema, models):
                problems.append(f"{doc.relative_to(REPO)}: unknown recipe key `{key}`")
    assert not problems, "\n".join(problems)


def test_every_flag_in_the_docs_exists_somewhere():
    """Backticked ``--flags`` in prose and the flags of ``python script.py`` commands in shell blocks."""
    known = set().union(*omniweave_options().values()) | EXTERNAL_FLAGS
    scripts = {p.relative_to(REPO).as_posix(): script_options(p) for p in (REPO / "bench").glob("*.py")}
    scripts.update({p.relative_to(REPO).as_posix(): script_options(p)
                    for p in (REPO / "omniweave/assets/tokenizers").glob("*.py")})
    known |= set().union(*scripts.values())
    problems = []
    for doc in DOCS:
        for flag in re.findall(r"`(--[a-z][\w-]*)", doc.read_text()):
            if flag not in known:
                problems.append(f"{doc.relative_to(REPO)}: `{flag}` is no flag of omniweave or bench/")
        written = {b.arg for b in shell_blocks(doc) if b.action == "file"}  # a script the doc itself shows
        for block in shell_blocks(doc):
            for words in python_scripts(block):
                if words[0] == "-m" or words[0] in written:
                    continue
                if words[0] not in scripts:
                    problems.append(f"{block.where()}: no script {words[0]}")
                    continue
                bad = [w for w in words[1:] if w.startswith("--") and w.split("=")[0] not in scripts[words[0]]]
                problems += [f"{block.where()}: {words[0]} has no flag {w}" for w in bad]
    assert not problems, "\n".join(problems)


def _key_table(doc: str, start: str, end: str) -> dict:
    text = (REPO / doc).read_text()
    section = text[text.index(start):text.index(end)]
    documented = {}
    for key, default in re.findall(r"^\| `([^`|]+)` \| ((?:[^|\\]|\\.)+) \|", section, re.M):
        default = default.strip().replace("\\|", "|")
        documented[key] = "???" if default == "—" else yaml.safe_load(default.strip("`"))
    return documented


def test_training_md_lists_exactly_the_recipe_schema():
    """The schema's keys, and per component exactly the optimisation keys train/optim.py reads."""
    from omniweave.train.optim import OPTIM_KEYS

    schema = {k: v for k, v in schema_defaults().items() if not k.startswith("rl.")}
    table = _key_table("docs/training.md", "## Recipe keys", "## What it writes")
    assert {k: v for k, v in table.items() if not k.startswith("model.")} == schema
    assert {k for k in table if k.startswith("model.")} == {f"model.<component>.{k}" for k in OPTIM_KEYS}


def test_rl_md_lists_exactly_the_rl_schema():
    schema = {k: v for k, v in schema_defaults().items() if k.startswith("rl.")}
    assert _key_table("docs/rl.md", "## Recipe keys (`rl:`)", "## Metrics") == schema


def test_every_shell_block_runs_or_says_why_not():
    """A skip must give a reason; a file block must name its path."""
    for doc in DOCS:
        for b in shell_blocks(doc):
            assert b.action == "run" or len(b.arg) > 8, f"{b.where()}: '{b.action}' needs a reason or path"


# ---------------------------------------------------------------------------- running them


@pytest.fixture(scope="session")
def demo_workspace(tmp_path_factory) -> Path:
    """runs/demo/{data,raw,packed} as `make demo` leaves them, small (160 samples)."""
    from omniweave.cli import main

    root = tmp_path_factory.mktemp("docs_demo")
    demo = root / "runs/demo"
    assert main(["data", "demo", str(demo / "data"), "--samples", "160", "--eval-samples", "20"]) == 0
    assert main(["data", "convert", "--input", str(demo / "data/train.jsonl"), "--media-dir", str(demo / "data/media"),
                 "--output", str(demo / "raw"), "--workers", "1", "--no-progress"]) == 0
    assert main(["data", "pack", "--input", str(demo / "raw"), "--output", str(demo / "packed"), "--recipe", "demo",
                 "--workers", "1"]) == 0
    return root


LINKED = ("omniweave", "bench", "tests", "Makefile", "pyproject.toml")  # the checkout, in the workspace


def _workspace(demo_workspace: Path, tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    shutil.copytree(demo_workspace, ws)
    os.symlink(sys.prefix, ws / ".venv")  # `. .venv/bin/activate` as in a checkout
    for name in LINKED:
        os.symlink(REPO / name, ws / name)
    return ws


def _linked_files() -> dict[str, tuple[int, int]]:
    """(mtime, size) of every file the workspace links to, bytecode caches left out."""
    out = {}
    for name in LINKED:
        root = REPO / name
        for f in [root] if root.is_file() else root.rglob("*"):
            if f.is_file() and "__pycache__" not in f.parts:
                st = f.stat()
                out[str(f.relative_to(REPO))] = (st.st_mtime_ns, st.st_size)
    return out


def run_doc(doc: Path, ws: Path, only: int | None = None) -> None:
    """Run ``doc``'s blocks in order (``only``: its file blocks and the run block at that line)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                           "MASTER_PORT", "PYTEST_XDIST_WORKER")}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO), MPLBACKEND="Agg")
    for b in shell_blocks(doc):
        if b.action == "file":
            (ws / b.arg).parent.mkdir(parents=True, exist_ok=True)
            (ws / b.arg).write_text(b.text)
        elif b.action == "run" and only in (None, b.line):
            script = "set -euo pipefail\nset -x\n" + "\n".join(scale(ln) for ln in logical_lines(b.text)) + "\n"
            r = subprocess.run(["bash", "-c", script], cwd=ws, env=env, capture_output=True, text=True, timeout=900)
            assert r.returncode == 0, f"{b.where()} failed (exit {r.returncode}):\n{r.stderr[-6000:]}\n{r.stdout[-2000:]}"


# docs whose blocks stand alone (one benchmark each): a test per block, so that the parallel test
# workers share them instead of one worker running every benchmark in a row
BY_BLOCK = ("benchmarks.md",)
RUNNABLE = [(d, None) for d in DOCS if d.name not in BY_BLOCK and any(b.action == "run" for b in shell_blocks(d))]
RUNNABLE += [(d, b.line) for d in DOCS if d.name in BY_BLOCK for b in shell_blocks(d) if b.action == "run"]


@pytest.mark.slow
@pytest.mark.parametrize("doc, only", RUNNABLE, ids=[d.name if n is None else f"{d.name}:{n}" for d, n in RUNNABLE])
def test_doc_commands_run_as_written(doc, only, demo_workspace, tmp_path):
    before = _linked_files()
    run_doc(doc, _workspace(demo_workspace, tmp_path), only)
    after = _linked_files()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"{doc.name}'s commands wrote into the checkout (e.g. bench/out): {changed[:10]}"
