"""One entry point: ``omniweave data|train|hf|demo …``.

Each command lives in its own module, which defines ``add_arguments(parser)`` and
``run(args) -> int``. Only the chosen command's module is imported, so ``--help`` and the
data tools start fast without importing torch.

Options and ``key=value`` overrides may come in any order. A user's mistake (``UserError``, a
missing file, a recipe key left unset) is one line on stderr and exit code 2; ``--debug``
anywhere on the command line shows the traceback instead. Output piped into a pager or ``head``
that closes early ends quietly.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys

from omniweave.errors import UserError

# (group, command) -> (module, one-line help). A command of ``None`` is a group-less command.
COMMANDS: dict[tuple[str, str | None], tuple[str, str]] = {
    ("data", "demo"): ("omniweave.data.demo", "generate the synthetic multimodal dataset"),
    ("data", "convert"): ("omniweave.data.sources.convert", "conversations JSON/JSONL + media -> raw shards"),
    ("data", "inspect"): ("omniweave.data.inspect", "summarise raw shards or a packed dataset"),
    ("data", "pack"): ("omniweave.data.packing.pack", "raw shards -> packed dataset"),
    ("train", None): ("omniweave.train.trainer", "train a recipe"),
    ("recipes", None): ("omniweave.recipes", "list the built-in recipes"),
    ("dpo", "precompute-ref"): ("omniweave.train.dpo_ref", "DPO reference log-probs of a pairs dataset, once"),
    ("rl", None): ("omniweave.rl.trainer", "reinforcement learning (GRPO) on packed RL prompts"),
    ("hf", "verify"): ("omniweave.models.hf.verify", "compare a HF model directory against omniweave"),
    ("hf", "export"): ("omniweave.models.hf.export", "export a checkpoint to a HF directory"),
    ("vla", "sample"): ("omniweave.vla.sample", "a trained VLA's action chunks for recorded robot frames"),
    ("generate", "video"): ("omniweave.diffusion.generate", "clips from a trained video-diffusion run, for prompts"),
    ("demo", None): ("omniweave.demo", "the whole pipeline on the synthetic dataset"),
    ("check", None): ("omniweave.check", "check this machine's kernels, models and parallel layouts"),
}


def _usage(only: str | None = None) -> str:
    """Every command, or only those of the group ``only`` (``omniweave data --help``)."""
    lines = [f"usage: omniweave {only or '<command>'} {'<command> ' if only else ''}[args]", "", "commands:"]
    for (group, cmd), (_, help_) in COMMANDS.items():
        if only in (None, group):
            name = group if cmd is None else f"{group} {cmd}"
            lines.append(f"  {name:<16} {help_}")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, like every other mistake; --help shows the usage
        self.exit(2, f"{self.prog}: error: {message} (--help shows the options)\n")


def main(argv: list[str] | None = None) -> int:
    from omniweave.launch import rank_started

    rank_started()  # a rank of `--nproc N` dies with its torchrun agent
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    group = argv[0]
    if (group, None) in COMMANDS:
        key, rest, prog = (group, None), argv[1:], f"omniweave {group}"
    else:
        cmd = argv[1] if len(argv) > 1 else None
        key, rest, prog = (group, cmd), argv[2:], f"omniweave {group} {cmd}"
        groups = {g for g, c in COMMANDS if c is not None}
        if group in groups and cmd in (None, "-h", "--help"):  # `omniweave data --help`: the group's commands
            print(_usage(group), file=sys.stdout if cmd else sys.stderr)
            return 0 if cmd else 2
        if key not in COMMANDS:
            print(_usage(group if group in groups else None), file=sys.stderr)
            print(f"\nomniweave: unknown command {' '.join(argv[:2])!r}", file=sys.stderr)
            return 2
    module_name, help_ = COMMANDS[key]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        print(f"omniweave: '{prog[10:]}' is not available in this version", file=sys.stderr)
        return 2
    parser = _Parser(prog=prog, description=help_)
    module.add_arguments(parser)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    args = parser.parse_intermixed_args(rest)  # key=value overrides may follow options
    args.debug = debug
    try:
        return int(module.run(args) or 0)
    except BrokenPipeError:  # `omniweave data inspect … | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:
        message = user_error_message(e)
        if message is None or debug:
            raise
        from omniweave.launch import report_from_rank

        if not report_from_rank(message):  # under --nproc the launcher prints it, once
            print(f"{prog}: error: {message}", file=sys.stderr)
        return 2


def user_error_message(e: BaseException) -> str | None:
    """The one line to show for a user's mistake; None for a bug (which keeps its traceback)."""
    from omegaconf.errors import MissingMandatoryValue

    from omniweave.train.watchdog import CollectiveFailure

    if isinstance(e, (UserError, CollectiveFailure)):  # a hang: the rank, the collective, where the stacks are
        return str(e)
    if isinstance(e, MissingMandatoryValue):  # a recipe key read before require() checked it
        from omniweave.config import unset_key_message

        return unset_key_message(getattr(e, "full_key", None) or "a recipe key")
    if isinstance(e, (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)) or (
            isinstance(e, OSError) and e.errno in FULL_OR_READ_ONLY):
        return f"{e.strerror or e}: {e.filename}" if e.filename else str(e)
    return None


FULL_OR_READ_ONLY = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # the user's disk, not our bug


if __name__ == "__main__":
    raise SystemExit(main())
