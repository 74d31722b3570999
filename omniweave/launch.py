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

Stopping (docs/training.md, "Stopping a run"): the chain launcher -> torchrun's agent -> ranks
holds both ways. SIGINT or SIGTERM to the launcher is forwarded to the agent as SIGTERM (a second
one as SIGKILL), which terminates its ranks at once — no final save: ``--resume auto`` continues
from the last complete checkpoint — and the launcher exits 128 + the signal's number with one line.
The agent runs in a session of its own (a terminal's Ctrl-C reaches the launcher only), and on
Linux each link dies with the one above it even when that one is SIGKILLed: the agent gets SIGTERM
when the launcher dies, a rank SIGKILL when the agent dies (``PR_SET_PDEATHSIG``,
:func:`die_with_parent`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import NoReturn

ERROR_FILE_ENV = "OMNIWEAVE_ERROR_FILE"
LAUNCHER_PID_ENV = "OMNIWEAVE_LAUNCHER_PID"  # the agent's parent: the agent dies with it
AGENT_PID_ENV = "OMNIWEAVE_AGENT_PID"  # the ranks' parent: each rank dies with it
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def torchrun(argv: list[str], nproc: int, nnodes: int = 1, rdzv_endpoint: str | None = None) -> tuple[int, str | None]:
    """Run ``python -m omniweave ARGV`` on ``nproc`` local ranks (of ``nnodes`` machines meeting at
    ``rdzv_endpoint``) -> (exit code, None or the line to print: ``error: <a rank's user error>``
    or ``stopped by SIGTERM: …``)."""
    where = (["--standalone"] if nnodes == 1 else
             [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", "--rdzv-id=omniweave"])
    # the agent: torchrun's, in this module's __main__ (dies with us, tells the ranks its pid)
    cmd = [sys.executable, "-m", "omniweave.launch", *where, f"--nproc-per-node={nproc}", "-m", "omniweave", *argv]
    with tempfile.TemporaryDirectory(prefix="omniweave-launch-") as tmp:
        error_file = Path(tmp) / "error"
        # torchrun sets OMP_NUM_THREADS=1 per rank anyway; setting it ourselves spares its banner about it
        env = {"OMP_NUM_THREADS": "1", **os.environ, ERROR_FILE_ENV: str(error_file),
               LAUNCHER_PID_ENV: str(os.getpid())}
        stopped: list[int] = []  # the stop signals received, in order
        agent: list[subprocess.Popen] = []
        with _forwarding_stop_signals(stopped, agent):
            agent.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, start_new_session=True))
            forward = threading.Thread(target=_forward_until, args=(agent[0].stderr, error_file, stopped), daemon=True)
            forward.start()
            code = agent[0].wait()
        forward.join()
        if stopped:
            name = signal.Signals(stopped[0]).name
            return 128 + stopped[0], (f"stopped by {name}: the ranks were ended without saving; --resume auto "
                                      "continues from the last complete checkpoint")
        if error_file.exists():
            return 2, f"error: {error_file.read_text().strip()}"
        return code, None


class _forwarding_stop_signals:
    """While the agent runs: SIGINT / SIGTERM to this process recorded in ``stopped`` and sent on
    to the agent as SIGTERM (it terminates its ranks), a second one as SIGKILL (the ranks then die
    with the agent). Only the main thread can set handlers; elsewhere the defaults stay."""

    def __init__(self, stopped: list[int], agent: list[subprocess.Popen]):
        self.stopped, self.agent, self.previous = stopped, agent, {}

    def _stop(self, signum, frame) -> None:
        self.stopped.append(signum)
        if self.agent and self.agent[0].poll() is None:
            self.agent[0].send_signal(signal.SIGTERM if len(self.stopped) == 1 else signal.SIGKILL)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._stop) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        if exc[0] is not None and self.agent and self.agent[0].poll() is None:  # we fail: the ranks stop too
            self.agent[0].kill()


def relaunch(command: str, args) -> int:
    """``omniweave COMMAND RECIPE [overrides] [--resume R]`` again on ``args.nproc`` ranks (of
    ``args.nnodes`` machines); a rank's user error printed once, as this command's; a stop signal's
    one line."""
    argv = [command, args.recipe, *args.overrides, *(["--resume", args.resume] if args.resume else [])]
    code, error = torchrun(argv, args.nproc, args.nnodes, args.rdzv_endpoint)
    if error:
        print(f"omniweave {command}: {error}", file=sys.stderr)
    return code


def _forward_until(stream, error_file: Path, stopped: list[int]) -> None:
    """Copy ``stream`` to our stderr as it comes (progress bars stay live), dropping what follows a
    reported user error or a stop signal (the other ranks' teardown and torchrun's failure summary)."""
    out = sys.stderr.buffer
    while chunk := os.read(stream.fileno(), 65536):
        if stopped or error_file.exists():
            continue
        out.write(chunk)
        out.flush()


def die_with_parent(parent_pid_env: str, sig: signal.Signals) -> None:
    """Linux: this process gets ``sig`` when its parent dies (``PR_SET_PDEATHSIG``), the parent
    being the process whose pid ``parent_pid_env`` holds; when that one is already gone (it died
    before we asked), ``sig`` now. No-op where the variable is unset or elsewhere than Linux."""
    expected = os.environ.get(parent_pid_env)
    if not expected or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(sig), 0, 0, 0)
    if os.getppid() != int(expected):
        os.kill(os.getpid(), sig)


def rank_started() -> None:
    """In a rank started by :func:`torchrun` (first thing in ``omniweave.cli.main``): SIGKILL when
    its agent dies."""
    if "LOCAL_RANK" in os.environ:
        die_with_parent(AGENT_PID_ENV, signal.SIGKILL)


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


def leave(code: int) -> NoReturn:
    """How ``python -m omniweave`` ends. A torchrun rank that returns (its run done, or a user
    error reported) flushes its streams and leaves with ``os._exit``: by then the run has drained
    its background work and destroyed its process groups (``train.engine.shutdown_distributed``),
    but torch's caches still hold the groups' gloo threads, and an interpreter teardown races them
    — a thread that needs the GIL once finalization has begun is unwound through a ``noexcept``
    destructor, and the rank of a successful run aborts with "terminate called without an active
    exception" (issue 31, item 10). Other processes, and a rank's uncaught error, exit as usual."""
    if "LOCAL_RANK" in os.environ:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing more to say
                pass
        os._exit(code)
    raise SystemExit(code)


def _agent_main(argv: list[str]) -> None:
    """``python -m omniweave.launch TORCHRUN_ARGS``: torchrun's agent, SIGTERMed (so it terminates
    its ranks) when the launcher dies, its pid handed to the ranks (:func:`rank_started`)."""
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    die_with_parent(LAUNCHER_PID_ENV, signal.SIGTERM)
    from torch.distributed.run import main

    main(argv)


if __name__ == "__main__":
    _agent_main(sys.argv[1:])
