"""bench/diffusion.py --quick: the three modes, every clip once, packed and bucketed without padding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_bench_diffusion_quick(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    r = subprocess.run([sys.executable, str(REPO / "bench/diffusion.py"), "--quick", "--out", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    for ext in ("png", "json", "md"):
        assert (tmp_path / f"diffusion.{ext}").is_file()
    rows = [ln for ln in (tmp_path / "diffusion.md").read_text().splitlines() if ln.startswith("| ") and "---" not in ln]
    assert [ln.split("|")[1].strip() for ln in rows[1:]] == ["packed", "padded", "bucketed"]
    res = json.loads((tmp_path / "diffusion.json").read_text())
    modes = res["modes"]
    assert modes["packed"]["padding"] == 0 and modes["bucketed"]["padding"] == 0
    assert modes["padded"]["padding"] > 0
    assert modes["padded"]["vs_padded"] == 1.0
    # every clip once: the useful tokens are the same in every mode, padding only adds computed ones
    for m in modes.values():
        assert m["computed"] * (1 - m["padding"]) == pytest.approx(res["tokens"])
        assert m["clips_per_step"] * m["steps"] == pytest.approx(res["clips"])
    assert modes["packed"]["largest_step"] <= res["settings"]["max_tokens"]
    assert modes["packed"]["gflop"] == pytest.approx(modes["bucketed"]["gflop"])
    assert modes["padded"]["gflop"] > modes["padded"]["gflop_key_mask"] > modes["packed"]["gflop"]
