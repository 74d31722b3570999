"""The CLI front door: lists commands, rejects unknown ones, dispatches lazily."""

import subprocess
import sys

from omniweave.cli import COMMANDS, main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for (group, cmd) in COMMANDS:
        assert (group if cmd is None else f"{group} {cmd}") in out


def test_unknown_command_exits_2(capsys):
    assert main(["data", "nope"]) == 2
    assert "unknown command 'data nope'" in capsys.readouterr().err


def test_no_args_prints_usage_and_fails(capsys):
    assert main([]) == 2


def test_module_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "omniweave", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "omniweave <command>" in r.stdout
