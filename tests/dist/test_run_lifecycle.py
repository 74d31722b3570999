"""How a run starts and ends (issue 31, items 4, 5 and 10; docs/training.md, "Stopping a run"):

- SIGTERM or SIGINT to the ``--nproc`` launcher, or SIGKILL of its process group, ends torchrun's
  agent and every rank within seconds; nothing writes a checkpoint afterwards; SIGTERM / SIGINT
  exit 128 + the signal with one line;
- a second run into a running run's output_dir is refused in one line naming the first's pid;
  after the first is SIGKILLed, ``--resume auto`` into the same directory proceeds;
- the tp 2 / encoder tp 1 layout's start-train-export-exit cycle, run again and again, exits 0
  every time without "terminate called" (a rank aborting at exit after a successful run).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.dist.test_multinode import _kill_job
from tests.train_factory import REPO, child_env, read_metrics, train_cmd

pytestmark = [pytest.mark.dist, pytest.mark.slow]

RANKS_GONE_S = 10  # measured on 2 loaded cores: 0.05-0.1 s
AGENT_GONE_S = 30  # torchrun's agent, which waits for its ranks and closes its store: 4-6 s measured
EXIT_CYCLES = int(os.environ.get("OMNIWEAVE_EXIT_CYCLES", "2"))  # ~30 s each on 2 idle cores; more to hunt a rare abort


def _run_processes(run: Path) -> list[int]:
    """The live processes whose command line names ``run`` (launcher, agent, ranks); zombies
    have an empty command line."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(run) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _start(demo_packed, run: Path, nproc: int, **kw) -> subprocess.Popen:
    return subprocess.Popen(train_cmd(demo_packed, run, nproc=nproc, **kw), env=child_env(), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_until(condition, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.2)


def _checkpoints(run: Path) -> dict[str, float]:
    root = run / "checkpoints"
    return {str(p.relative_to(root)): p.lstat().st_mtime for p in root.rglob("*")} if root.is_dir() else {}


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL to its process group"])
def test_stopping_the_launcher_ends_its_ranks_at_once(demo_packed, tmp_path, how):
    """2 ranks saving every step; once a step is logged the launcher is stopped: the agent and
    both ranks are gone within seconds and no checkpoint changes afterwards."""
    run = tmp_path / "run"
    launcher = _start(demo_packed, run, nproc=2, steps=1000, train__save_interval=1)
    try:
        _wait_until(lambda: read_metrics(run), "logged step")
        agent = [p for p in _run_processes(run) if "omniweave.launch" in _cmdline(p)]
        ranks = [p for p in _run_processes(run) if p != launcher.pid and p not in agent]
        assert len(agent) == 1 and len(ranks) == 2, _run_processes(run)
        t0 = time.monotonic()
        if how == "SIGKILL to its process group":
            os.killpg(launcher.pid, signal.SIGKILL)
        else:
            os.kill(launcher.pid, getattr(signal, how))
        _wait_until(lambda: not set(ranks) & set(_run_processes(run)), "end of the ranks", timeout=60)
        ranks_s = time.monotonic() - t0
        _wait_until(lambda: not _run_processes(run), "end of the agent", timeout=60)
        agent_s = time.monotonic() - t0
        assert ranks_s < RANKS_GONE_S and agent_s < AGENT_GONE_S
        stderr = launcher.communicate(timeout=60)[1]
        if how == "SIGKILL to its process group":
            assert launcher.returncode == -signal.SIGKILL
        else:
            assert launcher.returncode == 128 + getattr(signal, how)
            assert stderr.strip().splitlines()[-1] == (
                f"omniweave train: stopped by {how}: the ranks were ended without saving; --resume auto continues "
                "from the last complete checkpoint")
        saved = _checkpoints(run)
        time.sleep(3)
        assert _checkpoints(run) == saved  # no rank goes on writing
        print(f"{how}: ranks gone {ranks_s:.2f} s, agent {agent_s:.2f} s after the signal; exit {launcher.returncode}")
    finally:
        _kill_job(run)


def test_a_second_run_into_a_running_runs_output_dir_is_refused_until_the_first_dies(demo_packed, tmp_path):
    """A 1-process run holds its output_dir; a 2-rank run there exits 2 with one line naming the
    first's pid and writes nothing; after SIGKILL of the first, ``--resume auto`` proceeds."""
    run = tmp_path / "run"
    first = _start(demo_packed, run, nproc=1, steps=1000, train__save_interval=1)
    try:
        _wait_until(lambda: (run / "checkpoints" / "latest").exists(), "first checkpoint")
        config = (run / "config.yaml").read_text()
        second = subprocess.run(train_cmd(demo_packed, run, nproc=2, steps=1000, train__lr=0.5), env=child_env(),
                                cwd=REPO, capture_output=True, text=True, timeout=300)
        lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert lines[0].startswith(f"omniweave train: error: output_dir={run} is in use by another run "
                                   f"(pid {first.pid} on "), lines[0]
        assert (run / "config.yaml").read_text() == config  # the second run wrote nothing there
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    steps = max(r["step"] for r in read_metrics(run)) + 1
    resumed = subprocess.run(train_cmd(demo_packed, run, steps=steps, resume="auto"), env=child_env(), cwd=REPO,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]


def test_the_tp2_encoder_tp1_layout_exits_cleanly_every_time(demo_packed, tmp_path):
    """``EXIT_CYCLES`` short runs (1 step, HF export) of the layout whose rank 1 once aborted at exit
    after succeeding: every one exits 0 and no rank prints "terminate called"."""
    results = []
    t0 = time.monotonic()
    for i in range(EXIT_CYCLES):
        r = subprocess.run(train_cmd(demo_packed, tmp_path / f"run{i}", nproc=2, steps=1, model__foundation__tp=2,
                                     model__image_encoder__tp=1, train__save_hf=True),
                           env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
        results.append((r.returncode, "terminate called" in r.stderr))
        assert (tmp_path / f"run{i}" / "hf" / "config.json").exists(), r.stderr[-3000:]
    assert results == [(0, False)] * EXIT_CYCLES
    print(f"{EXIT_CYCLES} cycles in {time.monotonic() - t0:.0f} s, every exit clean")
