"""A wheel install (not editable) is complete: the built-in recipes and component configs ship as
package data and are found by name from any working directory; ``omniweave recipes`` and
``omniweave train --list`` list them. (A name that is neither a file nor built in: tests/test_cli.py.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.train_factory import REPO


def _run(*cmd, cwd, check=True) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "OMP_NUM_THREADS": "1"}  # no PYTHONPATH: the wheel only
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert not check or r.returncode == 0, f"{cmd}: exit {r.returncode}\n{r.stderr[-3000:]}\n{r.stdout[-2000:]}"
    return r


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> Path:
    """A fresh venv holding only the omniweave wheel (built from a copy of the checkout, so the build
    writes nothing here); its dependencies come from this interpreter's site-packages (a .pth file:
    the editable install's finder there is not run, so it cannot shadow the wheel)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    shutil.copytree(REPO / "omniweave", src / "omniweave", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", root / "dist", src, cwd=root)
    wheel = next((root / "dist").glob("omniweave-*.whl"))
    venv = root / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=root)
    purelib = Path(_run(venv / "bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                        cwd=root).stdout.strip())
    (purelib / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(sys.executable, "-m", "pip", "--python", venv / "bin/python", "install", "-q", "--no-deps", wheel, cwd=root)
    return venv


@pytest.mark.slow
def test_wheel_holds_every_builtin_config(wheel_venv):
    """Every YAML under omniweave/configs/ (recipes and component configs) is in the wheel."""
    wheel = next((wheel_venv.parent / "dist").glob("omniweave-*.whl"))
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("omniweave/configs/")}
    ours = {p.relative_to(REPO).as_posix() for p in (REPO / "omniweave/configs").rglob("*") if p.is_file()}
    assert len(ours) > 50 and ours == shipped, (sorted(ours - shipped), sorted(shipped - ours))


@pytest.mark.slow
def test_wheel_install_packs_with_a_builtin_recipe_from_another_directory(wheel_venv, tmp_path):
    """From a directory outside the checkout, the installed wheel (not this checkout) generates,
    converts and packs demo data with ``--recipe demo``, and lists the recipes."""
    bin_ = wheel_venv / "bin"
    where = _run(bin_ / "python", "-c", "import omniweave, omniweave.config as c; print(omniweave.__file__); "
                 "print(c.CONFIGS_DIR)", cwd=tmp_path).stdout.split()
    assert all(Path(p).is_relative_to(wheel_venv) for p in where), where  # the wheel's files, not REPO's
    _run(bin_ / "omniweave", "data", "demo", "data", "--samples", "24", "--eval-samples", "4", cwd=tmp_path)
    _run(bin_ / "omniweave", "data", "convert", "--input", "data/train.jsonl", "--media-dir", "data/media",
         "--output", "raw", "--workers", "1", "--no-progress", cwd=tmp_path)
    packed = _run(bin_ / "omniweave", "data", "pack", "--input", "raw", "--output", "packed", "--recipe", "demo",
                  "--workers", "1", cwd=tmp_path)
    assert "packed 24/24 samples" in packed.stdout + packed.stderr
    listing = _run(bin_ / "omniweave", "recipes", cwd=tmp_path).stdout
    assert "demo  " in listing and "tiny_qwen2_5_vl" in listing and str(wheel_venv) in listing
    assert _run(bin_ / "omniweave", "train", "--list", cwd=tmp_path).stdout == listing
