"""`omniweave check` on CPU (what CI can run): every row passes on a sound machine, a deliberately
broken kernel fails its rows and the exit code, a crashing group is a failed row, and a device the
machine lacks is a one-line error."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from omniweave import cli
from omniweave.check import kernels
from omniweave.models.components import attention


def _check(capsys, *args) -> tuple[int, str]:
    rc = cli.main(["check", "--device", "cpu", "--quick", *args])
    return rc, capsys.readouterr().out


def test_cpu_check_passes_and_reports_every_group(capsys, tmp_path):
    rc, out = _check(capsys, "--only", "kernels", "models", "speed", "--json", str(tmp_path / "rows.json"))
    assert rc == 0, out
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    names = {r["name"] for r in rows}
    for expected in ("sdpa float32 causal gqa 6:2 window 7 fwd+bwd", "sdpa bfloat16 bidirectional window 5 fwd+bwd",
                     "ring blocks math float32 fwd+bwd", "decode sdpa bfloat16 (cache slots)",
                     "qwen3 (qk-norm, head_dim 64): step grads", "qwen2.5-vl vision tower (windows): forward",
                     "training step learns", "MFU vs measured peak"):
        assert expected in names, (expected, names)
    assert {r["status"] for r in rows} <= {"pass", "skip", "info"}
    skipped = {r["name"]: r["note"] for r in rows if r["status"] == "skip"}
    if not torch.cuda.is_available():
        assert skipped["varlen"] == "needs a CUDA device"
    assert float(next(r for r in rows if r["name"] == "training tokens/s")["value"]) > 0
    assert "check: " in out.splitlines()[-1] and " 0 failed" in out.splitlines()[-1]


def _drops_the_window(q, k, v, cu_q, cu_k, causal, window=None, **kw):
    """A kernel with a classic bug: it ignores the sliding window."""
    return attention.sdpa_attn(q, k, v, cu_q, cu_k, causal, None, **kw)


def test_a_broken_kernel_fails_its_rows_and_the_exit_code(capsys, monkeypatch):
    broken = dataclasses.replace(attention.BACKENDS["sdpa"], attn=_drops_the_window)
    monkeypatch.setitem(attention.BACKENDS, "sdpa", broken)
    rc, out = _check(capsys, "--only", "kernels")
    assert rc == 1
    failed = [line[11:57].strip() for line in out.splitlines() if "  FAIL  " in line]  # the check column
    assert failed == [f"sdpa {dt} {case}" for dt in ("float32", "bfloat16")
                      for case in ("causal gqa 6:2 window 7 fwd+bwd", "bidirectional window 5 fwd+bwd")]
    assert "FAILED: kernels/sdpa float32 causal gqa 6:2 window 7 fwd+bwd" in out.splitlines()[-1]


def test_a_crashing_group_is_a_failed_row_not_a_traceback(capsys, monkeypatch):
    def boom(device, quick):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
        yield

    monkeypatch.setattr(kernels, "rows", boom)
    rc, out = _check(capsys, "--only", "kernels")
    assert rc == 1
    assert "(group crashed)" in out and "RuntimeError: CUDA error: an illegal memory access" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_asking_for_a_device_the_machine_lacks_is_one_line(capsys):
    assert cli.main(["check", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("omniweave check: error: --device cuda: device 'cuda' was requested but torch reports it "
                           "unavailable")
