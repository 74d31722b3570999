"""When a rank stops answering, every rank says where it was and the run exits instead of hanging.

A multi-node run hangs when one rank stops answering (a dead node, a stuck file system, a rank in
an endless loop): the others wait in their next collective until the scheduler kills the job,
and nothing says which rank or which collective. Here:

- Every collective runs under ``train.collective_timeout`` seconds (the process group's timeout:
  gloo raises in the waiting rank, NCCL's own watchdog aborts it).
- The backend's flight recorder keeps each rank's last ``FR_ENTRIES`` collectives (name, process
  group, sequence number, sizes); ``TORCH_FR_*`` / ``TORCH_NCCL_*`` set by the user win.
- A collective that fails on a rank (gloo's timeout, or a peer that went away) becomes
  :class:`CollectiveFailure`: one line naming the rank and the collective (the last one the
  flight recorder saw this rank enter), after the rank has written every thread's stack and its
  flight recorder to ``RUN/diagnostics/rank_R.txt`` and ``rank_R_flight_recorder.json``.
- A rank terminated or aborted meanwhile (torchrun sends SIGTERM to the survivors when one rank
  fails; NCCL's watchdog aborts; a segfault) writes its stacks to the same file from C, even
  while it is blocked inside a collective or stuck in a loop (``faulthandler``).

A clean finish removes the empty files. ``OMNIWEAVE_FAULT_HANG=RANK:STEP`` (tests) makes that
rank stop answering before step STEP.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import re
import signal
import time
import traceback
from pathlib import Path

DIAGNOSTICS = "diagnostics"
FR_ENTRIES = 2000
HANG_ENV = "OMNIWEAVE_FAULT_HANG"
# what gloo says when a collective cannot complete: its timeout, or a peer that is gone
_GLOO_FAILURE = re.compile(r"Timed out waiting|Connection closed by peer|Connection reset by peer|Broken pipe|"
                           r"Connection refused|Socket Timeout")


class CollectiveFailure(RuntimeError):
    """A collective did not complete: the message names the rank, the collective and where the
    stacks are (the CLI prints it as one line)."""


def prepare_environment(run_dir: Path) -> None:
    """Before the process group exists: the flight recorder on (gloo and NCCL), NCCL's dump of it
    on a timeout into the run's diagnostics. Variables the user set are kept."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FR_ENTRIES))
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(run_dir / DIAGNOSTICS / "nccl_flight_recorder_rank_"))


def timeout_of(cfg) -> datetime.timedelta:
    from omniweave.config import section

    seconds = float(section(cfg, "train").collective_timeout or 0)
    if seconds <= 0:
        raise ValueError(f"train.collective_timeout={seconds}: must be > 0 seconds")
    return datetime.timedelta(seconds=seconds)


class Watchdog:
    """One rank's diagnostics (see the module doc). ``with watchdog:`` turns a failed collective
    into :class:`CollectiveFailure`; ``close()`` after a clean finish."""

    def __init__(self, run_dir: Path, rank: int, timeout: datetime.timedelta):
        self.rank, self.timeout = rank, timeout
        self.dir = Path(run_dir) / DIAGNOSTICS
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stacks_path = self.dir / f"rank_{rank}.txt"
        self._file = open(self.stacks_path, "a")  # noqa: SIM115 - faulthandler writes to it until close(); a resumed
        # run keeps what an earlier failure wrote
        faulthandler.enable(self._file, all_threads=True)  # fatal signals: SIGSEGV, SIGABRT (NCCL's abort), ...
        faulthandler.register(signal.SIGTERM, self._file, all_threads=True, chain=True)

    def __enter__(self) -> "Watchdog":
        return self

    def __exit__(self, kind, error, tb) -> bool:
        if error is not None and is_collective_failure(error):
            raise CollectiveFailure(self.report(error)) from error
        return False

    def report(self, error: BaseException) -> str:
        """Write this rank's stacks and flight recorder; the one-line message."""
        entries = flight_recorder()
        fr_path = self.dir / f"rank_{self.rank}_flight_recorder.json"
        fr_path.write_text(json.dumps(entries, indent=1))
        self._file.write(f"rank {self.rank}: where the collective failed:\n")
        self._file.write("".join(traceback.format_exception(error)))
        self._file.write("\nevery thread now:\n")
        self._file.flush()
        faulthandler.dump_traceback(self._file, all_threads=True)
        self._file.flush()
        last = entries[-1] if entries else None
        what = (f"collective {last['profiling_name']} (#{last['collective_seq_id']} of process group "
                f"{_group_name(last)}, {_sizes(last)})" if last else "a collective")
        seconds = self.timeout.total_seconds()
        cause = "timed out" if "Timed out" in str(error) else "failed: a peer rank went away"
        return (f"rank {self.rank}: {what} {cause} (train.collective_timeout={seconds:g} s); another rank stopped "
                f"answering or died. Stacks: {self.dir}/rank_*.txt, flight recorder: {fr_path}")

    def close(self) -> None:
        """A clean finish: the handlers off, this rank's empty files removed."""
        faulthandler.unregister(signal.SIGTERM)
        faulthandler.disable()
        self._file.close()
        if self.stacks_path.stat().st_size == 0:
            self.stacks_path.unlink()
        try:
            self.dir.rmdir()  # only when every rank's file is gone
        except OSError:
            pass


def is_collective_failure(error: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(error, getattr(dist, "DistBackendError", ())) or (
        isinstance(error, RuntimeError) and bool(_GLOO_FAILURE.search(str(error))))


def flight_recorder() -> list[dict]:
    """This rank's recorded collectives, oldest first ([] where the build has no recorder)."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        return json.loads(_dump_fr_trace_json(True, False)).get("entries", [])
    except (ImportError, RuntimeError, ValueError):
        return []


def _group_name(entry: dict) -> str:
    group = entry.get("process_group") or ["?", "?"]
    return f"{group[1] or group[0]!r}"


def _sizes(entry: dict) -> str:
    sizes = entry.get("input_sizes") or []
    return "inputs " + ", ".join(str(list(s)) for s in sizes) if sizes else "no inputs"


def maybe_hang(rank: int, step: int) -> None:
    """Tests: with ``OMNIWEAVE_FAULT_HANG=RANK:STEP`` that rank stops answering before step STEP."""
    want = os.environ.get(HANG_ENV, "")
    if want and want == f"{rank}:{step}":
        while True:
            time.sleep(3600)
