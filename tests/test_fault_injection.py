"""Fault injection (issue 31): ``kill -9`` of convert, pack and train at seeded random moments
(training checkpoints every step, so kills land inside saves too), and a disk that fills up under
convert, pack and a checkpoint write. Afterwards nothing partial is trusted (the next tool refuses
it, or ``--resume auto`` passes over it) and every rerun / resume ends bit-identical to a run that
was never disturbed.

``OMNIWEAVE_FAULT_SEED`` / ``OMNIWEAVE_FAULT_KILLS`` pick other moments / more of them (the seed is
printed). Launcher signals and concurrent runs have their own tests: tests/dist/test_run_lifecycle.py,
tests/test_run_lock.py.
"""

from __future__ import annotations

import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omniweave.data import demo
from tests.train_factory import child_env, final_state, losses, max_abs_diff, train_cmd

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_intra_op_thread")]

REPO = Path(__file__).resolve().parents[1]
SEED = int(os.environ.get("OMNIWEAVE_FAULT_SEED", "0"))
KILLS = int(os.environ.get("OMNIWEAVE_FAULT_KILLS", "2"))


def omniweave(*args: str) -> list[str]:
    return [sys.executable, "-m", "omniweave", *args]


def run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout)


def kill_when(cmd: list[str], ready, delay: float, timeout: float = 300) -> bool:
    """Start ``cmd`` in its own process group; once ``ready()`` holds, wait ``delay`` s and SIGKILL the
    group. False if it finished before the kill (then it was not disturbed)."""
    proc = subprocess.Popen(cmd, env=child_env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    while not ready() and proc.poll() is None:
        assert time.monotonic() < deadline, f"{cmd[3:5]} never reached the moment to kill"
        time.sleep(0.02)
    time.sleep(delay)
    if proc.poll() is not None:
        return False
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return True


def tree_bytes(root: Path, pattern: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.glob(pattern))}


@pytest.fixture(scope="module")
def demo_rows(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fault_demo")
    demo.generate(root, samples=120, eval_samples=0)
    return root


def convert_cmd(rows: Path, out: Path) -> list[str]:
    return omniweave("data", "convert", "--input", str(rows / "train.jsonl"), "--media-dir", str(rows / "media"),
                     "--output", str(out), "--maxcount", "10", "--workers", "2", "--no-progress")


def pack_cmd(raw: Path, out: Path) -> list[str]:
    return omniweave("data", "pack", "--input", str(raw), "--output", str(out), "--recipe", "demo", "--max-len", "512",
                     "--packs-per-shard", "2", "--workers", "2")


@pytest.fixture(scope="module")
def reference(demo_rows, tmp_path_factory) -> dict:
    """Undisturbed convert and pack of the same rows: the bytes every disturbed run must end with."""
    root = tmp_path_factory.mktemp("fault_ref")
    assert run(convert_cmd(demo_rows, root / "raw")).returncode == 0
    assert run(pack_cmd(root / "raw", root / "packed")).returncode == 0
    return {"raw": tree_bytes(root / "raw", "shard-*"), "packed": tree_bytes(root / "packed", "packs-*"),
            "raw_dir": root / "raw", "manifest": (root / "packed" / "manifest.json").read_text()}


# ---------------------------------------------------------------------------- kill -9


def test_convert_killed_at_random_moments_reruns_to_the_same_shards(demo_rows, reference, tmp_path):
    rng = random.Random(SEED)
    for k in range(KILLS):
        raw = tmp_path / f"raw{k}"
        work = raw / ".work"
        done = rng.randint(0, 5)  # finished jobs (of 12) before the kill, then up to 0.3 s more
        killed = kill_when(convert_cmd(demo_rows, raw), lambda: len(list(work.glob("job-*.done.json"))) >= done,
                           rng.uniform(0, 0.3))
        # the shards are renamed into place, then the metadata written, then the report: a dataset is
        # readable only once its metadata is there, and then every shard is whole
        readable = (raw / ".nv-meta" / ".info.json").exists()
        print(f"seed {SEED} kill {k}: after {done} jobs, killed={killed}, readable={readable}")
        if readable:
            assert tree_bytes(raw, "shard-*") == reference["raw"]
        else:  # pack refuses the folder in one line
            r = run(pack_cmd(raw, tmp_path / f"p{k}"))
            assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        r = run(convert_cmd(demo_rows, raw))
        assert r.returncode == 0, r.stderr[-2000:]
        assert tree_bytes(raw, "shard-*") == reference["raw"]


def test_pack_killed_at_random_moments_reruns_to_the_same_packs(reference, tmp_path):
    rng = random.Random(SEED + 1)
    for k in range(KILLS):
        out = tmp_path / f"packed{k}"
        phase = rng.choice(["scan", "plan", "write"])  # the pack's folders appear phase by phase
        killed = kill_when(pack_cmd(reference["raw_dir"], out), lambda: (out / phase).exists() or
                           (phase == "write" and bool(list(out.glob("packs-*")))), rng.uniform(0, 0.2))
        finished = (out / "manifest.json").exists()  # written last: the packs are whole
        print(f"seed {SEED} kill {k}: in {phase}, killed={killed}, finished={finished}")
        if finished:
            assert tree_bytes(out, "packs-*") == reference["packed"]
        else:  # no manifest: training refuses it in one line
            r = run(train_cmd(out, tmp_path / f"run{k}", steps=1))
            assert r.returncode == 2 and "no packed dataset there" in r.stderr, r.stderr[-2000:]
        r = run(pack_cmd(reference["raw_dir"], out))
        assert r.returncode == 0, r.stderr[-2000:]
        assert tree_bytes(out, "packs-*") == reference["packed"]
        assert (out / "manifest.json").read_text() == reference["manifest"]


STEPS = 6


def _train(packed: Path, out: Path, resume: str | None = None) -> list[str]:
    return train_cmd(packed, out, resume=resume, steps=STEPS, train__save_interval=1, train__keep_last=2)


def test_train_killed_at_random_moments_resumes_bit_identically(demo_packed, tmp_path):
    """SIGKILL after a random step (+ up to 0.4 s: often inside that step's checkpoint write), then
    ``--resume auto`` until done, ``KILLS`` times in one run: the losses and every final weight equal the
    undisturbed run's exactly."""
    ref = tmp_path / "ref"
    assert run(_train(demo_packed, ref)).returncode == 0
    rng, out = random.Random(SEED + 2), tmp_path / "run"
    metrics = out / "metrics.jsonl"
    kills, resume = [], None
    for _ in range(KILLS):
        step = rng.randint(len(losses(out)) + 1 if out.exists() else 1, STEPS - 1)
        ready = (lambda s=step: metrics.exists() and len(metrics.read_text().splitlines()) >= s)
        kills.append((step, kill_when(_train(demo_packed, out, resume), ready, rng.uniform(0, 0.4))))
        resume = "auto"
        if out.joinpath("checkpoints").exists():  # what a kill leaves is never read: only complete ones
            assert all(p.name.startswith(("step_", ".tmp-step_", "latest")) for p in (out / "checkpoints").iterdir())
    print(f"seed {SEED}: killed after steps {kills}")
    r = run(_train(demo_packed, out, resume))
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(out) == losses(ref)
    assert max_abs_diff(final_state(out), final_state(ref)) == 0.0


# ---------------------------------------------------------------------------- a full disk


def on_small_disk(disk: Path, script: str, size_mb: float) -> subprocess.CompletedProcess:
    """Run the bash ``script`` with a tmpfs of ``size_mb`` MiB mounted at ``disk``, in a mount namespace
    of its own (nothing to clean up: it vanishes with the script); ``remount SIZE`` resizes it, ``small
    DIR SIZE`` mounts another. Skipped,
    with the reason, where the machine allows no such mount (no root, no ``unshare``)."""
    if shutil.which("unshare") is None:
        pytest.skip("no `unshare` here: cannot give a process a small disk of its own")
    disk.mkdir()
    body = (f"remount() {{ mount -o remount,size=$1 {shlex.quote(str(disk))}; }}\n"
            "small() { mkdir -p \"$1\" && mount -t tmpfs -o size=$2 tmpfs \"$1\"; }\n"
            f"mount -t tmpfs -o size={int(size_mb * 1024)}k tmpfs {shlex.quote(str(disk))} || exit 99\n{script}")
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", body], env=child_env(),
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    if r.returncode == 99 or "unshare failed" in r.stderr:
        pytest.skip(f"this machine allows no private tmpfs mount (root in a mount namespace): {r.stderr.strip()[:200]}")
    return r


def test_a_disk_full_checkpoint_write_is_one_line_and_resume_is_bit_identical(demo_packed, tmp_path):
    """Room for two checkpoints, not three: the run stops at the third save with one line naming the
    checkpoint, the space and the newest complete one; its partial files are gone; once the disk is
    larger, ``--resume auto`` ends like the undisturbed run, bit for bit."""
    ref, disk, out = tmp_path / "ref", tmp_path / "disk", tmp_path / "out"
    kw = dict(steps=STEPS, train__save_interval=2, train__keep_last=0)
    assert run(train_cmd(demo_packed, ref, **kw)).returncode == 0
    checkpoint_mb = sum(f.stat().st_size for f in (ref / "checkpoints/step_000002").iterdir()) / 2**20
    t = shlex.quote(str(tmp_path))
    script = (f"{shlex.join(train_cmd(demo_packed, disk / 'run', **kw))} 2> {t}/first.err; echo $? > {t}/first.rc\n"
              f"ls -a {disk}/run/checkpoints > {t}/after_fail.txt\n"
              f"remount {int(4 * checkpoint_mb + 8)}m\n"
              f"{shlex.join(train_cmd(demo_packed, disk / 'run', resume='auto', **kw))} > {t}/resumed.out 2>&1 || exit 3\n"
              f"cp -a {disk}/run {shlex.quote(str(out))}\n")
    r = on_small_disk(disk, script, 2.6 * checkpoint_mb)
    resumed = (tmp_path / "resumed.out").read_text() if (tmp_path / "resumed.out").exists() else ""
    assert r.returncode == 0, (r.stderr[-2000:], resumed[-2000:])
    err = (tmp_path / "first.err").read_text().strip().splitlines()
    assert (tmp_path / "first.rc").read_text().strip() == "2"
    assert len(err) == 1 and err[0].startswith("omniweave train: error: could not write checkpoint step_000006"), err
    assert "MiB were free there" in err[0] and "the newest complete checkpoint (step_000004) is untouched" in err[0]
    assert (tmp_path / "after_fail.txt").read_text().split() == [".", "..", "latest", "step_000002", "step_000004"]
    assert "resumed from" in resumed
    assert losses(out) == losses(ref)
    assert max_abs_diff(final_state(out), final_state(ref)) == 0.0


def test_convert_and_pack_on_a_full_disk_fail_in_one_line_and_rerun_cleanly(demo_rows, reference, tmp_path):
    """Half the shards' size: convert stops with one line and leaves nothing that looks finished; on a
    larger disk it reruns to the reference shards. Pack, with room for the shards only, the same."""
    raw_mb = sum(len(b) for b in reference["raw"].values()) / 2**20
    packed_mb = sum(len(b) for b in reference["packed"].values()) / 2**20
    disk, t = tmp_path / "disk", shlex.quote(str(tmp_path))
    convert, pack = shlex.join(convert_cmd(demo_rows, disk / "raw")), shlex.join(pack_cmd(disk / "raw", disk / "p/packed"))
    script = (f"{convert} 2> {t}/convert.err; echo $? > {t}/convert.rc\n"
              f"ls -a {disk}/raw > {t}/raw_after.txt\n"
              f"remount {int(3 * raw_mb + 4)}m\n"
              f"{convert} > /dev/null || exit 3\n"
              f"small {disk}/p {int(packed_mb / 2 * 1024)}k\n"  # the packs' disk: room for half of them
              f"{pack} 2> {t}/pack.err; echo $? > {t}/pack.rc\n"
              f"ls -a {disk}/p/packed > {t}/packed_after.txt\n"
              f"mount -o remount,size={int(4 * packed_mb + 8)}m {disk}/p\n"
              f"{pack} > /dev/null 2>&1 || exit 4\n"
              f"cp -a {disk}/raw {disk}/p/packed {t}/\n")
    r = on_small_disk(disk, script, raw_mb / 2)
    assert r.returncode == 0, r.stderr[-3000:]
    for tool in ("convert", "pack"):
        err = (tmp_path / f"{tool}.err").read_text()
        assert (tmp_path / f"{tool}.rc").read_text().strip() != "0", (tool, err[-2000:])
        last = err.strip().splitlines()[-1]  # after pack's progress bars
        assert "Traceback" not in err and "No space left on device" in last, (tool, err[-2000:])
        print(last)
    assert "convert_report.json" not in (tmp_path / "raw_after.txt").read_text()
    assert "manifest.json" not in (tmp_path / "packed_after.txt").read_text()
    assert tree_bytes(tmp_path / "raw", "shard-*") == reference["raw"]
    assert tree_bytes(tmp_path / "packed", "packs-*") == reference["packed"]
