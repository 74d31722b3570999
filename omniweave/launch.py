"""``--nproc N``: re-run a command under ``torchrun --standalone --nproc-per-node N``, with one error line.

``--nnodes M --rdzv-endpoint HOST:PORT`` (the same command on each of M machines): the nodes meet
at torchrun's c10d rendezvous on HOST:PORT (one of them) instead of ``--standalone``; ranks are
numbered node by node, so a node's ranks are consecutive (what HSDP's layout relies on,
parallel/dims.py).

Without care a user's mistake found inside the ranks (a dataset that does not match the recipe, a
checkpoint of another model) prints N tracebacks and torchrun's ``ChildFailedError`` block. Here
the ranks report a user error by writing it to a file named by ``ERROR_FILE_ENV`` (the first rank
to fail wins) and exit 2 without printing; the launcher forwards the ranks' stderr live until that
file appears — after it there is only the failure noise — and then prints the message once.
Bugs keep their tracebacks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ERROR_FILE_ENV = "OMNIWEAVE_ERROR_FILE"


def torchrun(argv: list[str], nproc: int, nnodes: int = 1, rdzv_endpoint: str | None = None) -> tuple[int, str | None]:
    """Run ``python -m omniweave ARGV`` on ``nproc`` local ranks (of ``nnodes`` machines meeting at
    ``rdzv_endpoint``) -> (exit code, user error or None)."""
    where = (["--standalone"] if nnodes == 1 else
             [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", "--rdzv-id=omniweave"])
    cmd = [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc-per-node={nproc}", "-m", "omniweave", *argv]
    with tempfile.TemporaryDirectory(prefix="omniweave-launch-") as tmp:
        error_file = Path(tmp) / "error"
        # torchrun sets OMP_NUM_THREADS=1 per rank anyway; setting it ourselves spares its banner about it
        env = {"OMP_NUM_THREADS": "1", **os.environ, ERROR_FILE_ENV: str(error_file)}
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
        forward = threading.Thread(target=_forward_until, args=(proc.stderr, error_file), daemon=True)
        forward.start()
        code = proc.wait()
        forward.join()
        if error_file.exists():
            return 2, error_file.read_text().strip()
        return code, None


def relaunch(command: str, args) -> int:
    """``omniweave COMMAND RECIPE [overrides] [--resume R]`` again on ``args.nproc`` ranks (of
    ``args.nnodes`` machines); a rank's user error printed once, as this command's."""
    argv = [command, args.recipe, *args.overrides, *(["--resume", args.resume] if args.resume else [])]
    code, error = torchrun(argv, args.nproc, args.nnodes, args.rdzv_endpoint)
    if error:
        print(f"omniweave {command}: error: {error}", file=sys.stderr)
    return code


def _forward_until(stream, error_file: Path) -> None:
    """Copy ``stream`` to our stderr as it comes (progress bars stay live), dropping what follows a
    reported user error (the other ranks' teardown and torchrun's failure summary)."""
    out = sys.stderr.buffer
    while chunk := os.read(stream.fileno(), 65536):
        if error_file.exists():
            continue
        out.write(chunk)
        out.flush()


def report_from_rank(message: str) -> bool:
    """In a rank started by :func:`torchrun`: hand ``message`` to the launcher; False elsewhere."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or "LOCAL_RANK" not in os.environ:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:  # another rank reported first: one message per run
        return True
    with os.fdopen(fd, "w") as f:
        f.write(message)
    return True


def add_arguments(p) -> None:
    """The launch options of the training commands (train, rl)."""
    p.add_argument("--nproc", type=int, default=1, help="processes on this machine (runs itself under torchrun)")
    p.add_argument("--nnodes", type=int, default=1,
                   help="machines taking part (run the same command on each; needs --rdzv-endpoint)")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="with --nnodes > 1: where the machines meet (torchrun's c10d rendezvous, on one of them)")


def wants_launch(args) -> bool:
    """Whether this process is the launcher of several ranks (not a rank itself); bad options are a
    UserError."""
    from omniweave.errors import UserError

    if args.nnodes < 1 or args.nproc < 1:
        raise UserError(f"--nproc {args.nproc} and --nnodes {args.nnodes} must be >= 1")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise UserError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (where the machines meet: a port "
                        "on one of them that the others reach)")
    return (args.nproc > 1 or args.nnodes > 1) and "LOCAL_RANK" not in os.environ
