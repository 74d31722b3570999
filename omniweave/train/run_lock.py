"""One run per output_dir: ``OUTPUT_DIR/.lock``, an exclusive ``flock`` held by rank 0 for the run.

Two runs writing one directory corrupt each other (one's ``config.yaml`` over the other's,
interleaved ``metrics.jsonl``, a save deleted under the other's feet). Rank 0 takes the lock
before anything is written into the directory and tells every rank whether it got it (one
broadcast), so a refused run stops on all ranks with one line naming the holder — its pid, host
and start time, which the holder wrote into the file. The kernel drops a ``flock`` when its
process ends, however it ends: a run killed with SIGKILL leaves no stale lock, and ``--resume
auto`` into the same directory proceeds.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path

LOCK_NAME = ".lock"


class RunLock:
    """The lock on ``run_dir`` (held by rank 0; the other ranks hold nothing). ``with lock:``
    releases it when the run ends, whatever ends it."""

    def __init__(self, run_dir: Path, rank: int):
        self.path = Path(run_dir) / LOCK_NAME
        self.fd: int | None = None
        refusal = self._acquire() if rank == 0 else None
        refusal = _from_rank0(refusal)
        if refusal:
            from omniweave.errors import UserError

            raise UserError(refusal)

    def _acquire(self) -> str | None:
        """Rank 0: the lock taken and this run written into it (None), or why not."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(os.read(fd, 4096))
            os.close(fd)
            return (f"output_dir={self.path.parent} is in use by another run ({holder}; lock file {self.path}); "
                    "wait for it to end, stop it, or choose another output_dir")
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.datetime.now().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(me).encode())
        self.fd = fd
        return None

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # a lock file left behind names nobody
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> bool:
        self.release()
        return False


def _holder(raw: bytes) -> str:
    try:
        who = json.loads(raw)
        return f"pid {who['pid']} on {who['host']}, started {who['started']}"
    except (ValueError, KeyError, TypeError):  # written by nothing we know, or mid-write
        return "holder unknown"


def _from_rank0(refusal: str | None) -> str | None:
    """Rank 0's answer on every rank (a collective when there are several)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return refusal
    box = [refusal]
    dist.broadcast_object_list(box, src=0)
    return box[0]
