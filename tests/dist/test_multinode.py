"""Several nodes, as users outgrow one (docs/parallelism.md, "Several nodes"): gloo on CPU.

- two ``omniweave train --nnodes 2 --rdzv-endpoint 127.0.0.1:PORT`` launches (2 ranks each,
  torchrun's c10d rendezvous) train with HSDP 2 x 2 like one process; HSDP composes with pipeline
  stages and with expert parallelism (4-rank runs against one rank);
- ``train.async_save``: a run killed with SIGKILL while a checkpoint is still being written in the
  background leaves it unpublished and resumes bit-identically;
- a rank that stops answering makes the other exit within ``train.collective_timeout`` with one
  line naming the rank and the collective, and every rank's stacks in ``RUN/diagnostics/``.
(HSDP's gradients and placements against one process: tests/dist/test_layout_parity.py.)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.dist.test_train_dist import LAYOUT_WEIGHT_ATOL, LOSS_RTOL, SAVE, STEPS, _assert_same_losses, _run, _run_dir_at
from tests.train_factory import (
    REPO, child_env, final_state, losses, max_abs_diff, read_metrics, train_cmd, train_subprocess,
)

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_job(run) -> None:
    """SIGKILL every process of the run (launcher, torchrun, ranks: torchrun starts each rank in a
    session of its own), as when its machine dies."""
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(run) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def _assert_trains_like(run, ref, weight_atol: float = LAYOUT_WEIGHT_ATOL) -> str:
    rel = _assert_same_losses(losses(run), losses(ref), LOSS_RTOL)
    got, want = read_metrics(run), read_metrics(ref)
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]
    gnorm = max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(got, want))
    assert gnorm <= LOSS_RTOL
    dw = max_abs_diff(final_state(run), final_state(ref))
    assert dw <= weight_atol
    return f"loss max rel Δ {rel:.2e}, grad-norm {gnorm:.2e}, weights max |Δ| {dw:.2e}"


def test_two_nodes_with_hsdp_train_like_one_process(demo_packed, tmp_path_factory, tmp_path):
    """Two launches of the same command, as on two machines, meet at a c10d rendezvous on
    127.0.0.1 (2 ranks each: ranks 0-1 on the first "node", 2-3 on the second); with
    ``parallel.dp_replicate=2`` each node holds one replica sharded over its 2 ranks. Losses,
    token counts, grad norms and final weights equal the 1-rank run, and its step-2 checkpoint
    resumed in one plain process ends like it too (DCP reshards; the layout is not recorded)."""
    ref = _run(demo_packed, tmp_path_factory, 1)
    run, port = tmp_path / "run", _free_port()
    cmd = train_cmd(demo_packed, run, nproc=2, steps=STEPS, train__save_interval=SAVE, train__keep_last=0,
                    parallel__dp_replicate=2) + ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    nodes = [subprocess.Popen(cmd, env=child_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for _ in range(2)]
    try:
        outputs = [node.communicate(timeout=400)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert any("cpu x4 (dp=4 (HSDP: 2 replicas x 2 shards)" in o for o in outputs), outputs
    print(f"2 nodes x 2 ranks, HSDP 2 x 2: {_assert_trains_like(run, ref)}")
    resumed = _run_dir_at(run, SAVE, tmp_path / "resumed")  # its step-2 checkpoint, on one plain process
    res = train_subprocess(demo_packed, resumed, resume="auto", steps=STEPS, train__save_interval=SAVE,
                           train__keep_last=0)
    assert res.returncode == 0 and "resumed from" in res.stdout, res.stdout[-3000:]
    print(f"its step-{SAVE} checkpoint resumed on 1 rank: {_assert_trains_like(resumed, ref)}")


@pytest.mark.parametrize("recipe, parallel", [
    ("demo", {"parallel__pp": 2, "parallel__dp_replicate": 2, "model__foundation__num_layers": 4}),
    ("demo_moe", {"parallel__dp_replicate": 2, "parallel__ep": 2, "model__foundation__aux_loss_level": "sequence"}),
], ids=["pp2xhsdp2x1", "hsdp2x2-ep2"])
def test_hsdp_composes_with_pipeline_and_expert_parallelism(demo_packed, tmp_path_factory, recipe, parallel):
    """4 ranks: pp 2 with each stage's part replicated over 2 dp ranks (HSDP 2 x 1 per stage), and
    a MoE model with HSDP 2 x 2 and each MoE layer's experts split over the 2 ranks of a replica
    (ep 2 inside a replica, so the experts are HSDP-sharded too; the sequence-wise balance loss,
    which does not depend on how rows are spread over ranks): the 1-rank run's losses, grad norms
    and final weights."""
    layers = {k: v for k, v in parallel.items() if k.startswith("model__")}
    ref = _run(demo_packed, tmp_path_factory, 1, recipe=recipe, **layers)
    run = _run(demo_packed, tmp_path_factory, 4, recipe=recipe, **parallel)
    assert "HSDP: 2 replicas" in (run / "stdout.txt").read_text()
    print(f"{recipe} {parallel}: {_assert_trains_like(run, ref)}")


def test_kill_during_async_save_resumes_bit_identically(demo_packed, tmp_path_factory, tmp_path):
    """2 ranks, ``train.async_save``, the background writes slowed down (a test hook): training
    goes on while a checkpoint is written (step 5 runs before step_000004 is published); SIGKILL of
    the whole run at that moment leaves ``.tmp-step_000004`` unpublished and ``latest`` at step 2;
    ``--resume auto`` then ends with the uninterrupted run's losses and weights, bit for bit."""
    ref = _run(demo_packed, tmp_path_factory, 2)
    run, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    kw = dict(nproc=2, steps=STEPS, train__save_interval=SAVE, train__keep_last=0, train__async_save=True)
    proc = subprocess.Popen(train_cmd(demo_packed, run, **kw), env=child_env(OMNIWEAVE_SLOW_ASYNC_SAVE="8"), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    try:
        while True:  # step 5 done, step_000002 published, step_000004 still being written
            rows = read_metrics(run)
            if rows and rows[-1]["step"] >= 5 and (ckpts / "step_000002").is_dir():
                break
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the moment to kill it"
            time.sleep(0.05)
        assert (ckpts / ".tmp-step_000004").is_dir() and not (ckpts / "step_000004").exists()
    finally:
        _kill_job(run)
    proc.wait()
    time.sleep(1)  # the killed ranks' files closed
    assert (ckpts / "latest").resolve().name == "step_000002"
    res = train_subprocess(demo_packed, run, resume="auto", **kw)
    assert res.returncode == 0, res.stdout[-4000:]
    assert "step_000002 at step 2" in res.stdout
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000002", "step_000004", "step_000006"]
    assert losses(run) == losses(ref)
    assert max_abs_diff(final_state(run), final_state(ref)) == 0.0


def test_rank_that_stops_answering_stops_the_run_naming_rank_and_collective(demo_packed, tmp_path):
    """Rank 1 stops answering before step 3 (a test hook); rank 0 waits in that step's first
    collective. With ``train.collective_timeout=10`` the run exits (code 2) about 10 s after step 2
    with one line naming rank 0 and the collective; rank 0's diagnostics hold the failed
    collective's traceback and every thread's stack, its flight recorder the collectives it
    entered; rank 1's hold its stack where it stopped (written when torchrun terminated it)."""
    run = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(demo_packed, run, nproc=2, steps=STEPS, train__collective_timeout=10),
                            env=child_env(OMNIWEAVE_FAULT_HANG="1:3"), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        while not (read_metrics(run) and read_metrics(run)[-1]["step"] == 2):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.05)
        hung_at = time.monotonic()
        out, _ = proc.communicate(timeout=120)
        waited = time.monotonic() - hung_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2, out[-3000:]
    assert 10 <= waited <= 40, waited
    line = next(ln for ln in out.splitlines() if "error:" in ln)
    assert line.startswith("omniweave train: error: rank 0: collective gloo:") and "timed out" in line, line
    assert "train.collective_timeout=10 s" in line and "diagnostics" in line
    diagnostics = run / "diagnostics"
    rank0, rank1 = ((diagnostics / f"rank_{r}.txt").read_text() for r in (0, 1))
    assert "where the collective failed" in rank0 and "_train_loop" in rank0 and "every thread now" in rank0
    assert "maybe_hang" in rank1  # its stack where it stopped answering
    recorded = json.loads((diagnostics / "rank_0_flight_recorder.json").read_text())
    assert recorded and recorded[-1]["profiling_name"] in line
    print(f"exited {waited:.1f} s after rank 1 stopped: {line}")
