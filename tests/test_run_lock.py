"""The output_dir lock (omniweave/train/run_lock.py) without a training run: refused while held,
naming the holder; free again after release, and after its holder is SIGKILLed (no stale lock)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from omniweave.errors import UserError
from omniweave.train.run_lock import LOCK_NAME, RunLock
from tests.train_factory import child_env


def test_a_held_lock_refuses_a_second_holder_naming_the_first_and_is_free_after_release(tmp_path):
    first = RunLock(tmp_path / "run", rank=0)
    with pytest.raises(UserError) as refused:
        RunLock(tmp_path / "run", rank=0)
    message = str(refused.value)
    assert "\n" not in message
    assert f"output_dir={tmp_path / 'run'} is in use by another run (pid {os.getpid()} on " in message
    first.release()
    assert (tmp_path / "run" / LOCK_NAME).read_text() == ""  # a lock file left behind names nobody
    with RunLock(tmp_path / "run", rank=0) as again:
        assert again.fd is not None
    assert again.fd is None


def test_other_ranks_take_no_lock(tmp_path):
    with RunLock(tmp_path / "run", rank=0):
        assert RunLock(tmp_path / "run", rank=1).fd is None  # rank 0 holds it for the run


def test_a_sigkilled_holder_leaves_no_stale_lock(tmp_path):
    run = tmp_path / "run"
    script = ("import time\nfrom omniweave.train.run_lock import RunLock\n"
              f"lock = RunLock({str(run)!r}, 0)\nprint('held', flush=True)\ntime.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", script], env=child_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=f"pid {holder.pid} on "):
            RunLock(run, rank=0)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    deadline = time.monotonic() + 10
    while True:  # the kernel drops the flock with the process
        try:
            RunLock(run, rank=0).release()
            break
        except UserError:
            assert time.monotonic() < deadline, "the lock outlived its SIGKILLed holder"
            time.sleep(0.1)
