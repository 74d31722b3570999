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


def test_a_group_lists_its_commands(capsys):
    """`omniweave data --help` (and `omniweave hf -h`) list the group's commands; `omniweave data`
    alone does too, and fails; an unknown command of a group shows the group's."""
    assert main(["data", "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: omniweave data <command>" in out and all(f"data {c}" in out for c in ("demo", "convert", "pack", "inspect"))
    assert "train" not in out and "hf export" not in out
    assert main(["hf", "-h"]) == 0 and "hf verify" in capsys.readouterr().out
    assert main(["data"]) == 2 and "data convert" in capsys.readouterr().err
    assert main(["data", "nope"]) == 2
    err = capsys.readouterr().err
    assert "data pack" in err and "hf export" not in err


def test_module_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "omniweave", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "omniweave <command>" in r.stdout


# ---------------------------------------------------------------------------- a user's first mistakes
# Each is one line on stderr, exit 2, no traceback (issue 15): under --nproc too, and once per run.

import argparse  # noqa: E402

import pytest  # noqa: E402

from omniweave.config import builtin_recipe_paths  # noqa: E402
from tests.train_factory import child_env  # noqa: E402


def omniweave(*argv, cwd=None):
    return subprocess.run([sys.executable, "-m", "omniweave", *map(str, argv)], capture_output=True, text=True,
                          env=child_env(), cwd=cwd, timeout=240)


def assert_one_line_error(r, *fragments):
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "error:" in lines[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_overrides_may_follow_options():
    from omniweave.train import trainer

    p = argparse.ArgumentParser()
    trainer.add_arguments(p)
    args = p.parse_intermixed_args(["demo", "--nproc", "4", "parallel.cp=2", "--resume", "auto", "model.foundation.tp=2"])
    assert args.nproc == 4 and args.resume == "auto" and args.overrides == ["parallel.cp=2", "model.foundation.tp=2"]


@pytest.mark.parametrize("argv, fragments", [
    (["train", "dmeo"], ["recipe 'dmeo' not found", "did you mean 'demo'?"]),
    (["train", "demo", "train.step=3"], ["unknown recipe key 'train.step'; did you mean 'train.steps'?"]),
    (["train", "demo", "data.path=nowhere"], ["data.path=nowhere: no packed dataset there"]),
    (["train", "demo", "--nproc", "2", "data.path=nowhere"], ["data.path=nowhere: no packed dataset there"]),
    (["data", "pack", "--input", "nowhere", "--output", "p", "--recipe", "demo"], ["not a raw dataset"]),
    (["data", "pack", "--input", "nowhere", "--output", "p", "--recipe", "demo", "data.max_lne=9"],
     ["did you mean 'data.max_len'?"]),
    (["train", "demo", "data.path=nowhere", "model.foundation.attn_backend=flsh"],
     ["model.foundation.attn_backend: unknown attention backend 'flsh'; choose from auto, varlen, flash, sdpa, math",
      "available here: auto"]),
    (["rl", "demo_grpo", "data.path=nowhere", "model.image_encoder.attn_backend=flash"],
     ["model.image_encoder.attn_backend: attention backend 'flash' is not available on this machine",
      "available here: auto"]),
    (["train", "demo", "--nproc", "2", "--nnodes", "2"], ["--nnodes 2 needs --rdzv-endpoint HOST:PORT"]),
    (["rl", "demo_grpo", "--nnodes", "0"], ["--nproc 1 and --nnodes 0 must be >= 1"]),
    (["hf", "export", "nowhere", "--output", "hf"], ["nowhere"]),
    (["hf", "verify", "nowhere"], ["no config.json"]),
    # every command that takes a recipe resolves it the same way: a name neither built in nor a file
    # lists the built-in names (issue 30)
    *[(argv, ["recipe 'no_such_recipe' not found",
              f"built-in: {', '.join(p.stem for p in builtin_recipe_paths())} (omniweave recipes describes them)"])
      for argv in (["train", "no_such_recipe"], ["rl", "no_such_recipe"], ["dpo", "precompute-ref", "no_such_recipe"],
                   ["demo", "--recipe", "no_such_recipe"],
                   ["data", "pack", "--input", "raw", "--output", "p", "--recipe", "no_such_recipe"])],
    (["demo", "--rl", "--recipe", "demo_moe"], ["--recipe is for the SFT demo; --rl runs its own recipes"]),
    (["demo", "--dpo", "--recipe", "demo_moe"], ["--recipe is for the SFT demo; --dpo runs its own recipes"]),
    (["train", "demo", "--list"], ["--list takes no recipe or overrides"]),
    # numbers out of range: one line naming the key or flag (issue 31, item 11)
    *[(["train", "demo", override], [message]) for override, message in (
        ("train.steps=0", "train.steps=0: must be >= 1"),
        ("train.max_bad_steps=0", "train.max_bad_steps=0: must be >= 1"),
        ("train.warmup=-1", "train.warmup=-1: must be >= 0"),
        ("train.save_interval=-5", "train.save_interval=-5: must be >= 0"),
        ("train.keep_last=-1", "train.keep_last=-1: must be >= 0"),
        ("train.grad_clip=-1", "train.grad_clip=-1.0: must be >= 0"),
        ("train.min_lr_ratio=1.5", "train.min_lr_ratio=1.5: must be between 0 and 1"),
        ("parallel.cp=0", "parallel.cp=0: must be >= 1"))],
    (["train", "demo", "--nproc", "0"], ["--nproc 0 and --nnodes 1 must be >= 1"]),
    (["data", "pack", "--input", "raw", "--output", "p", "--recipe", "demo", "--packs-per-shard", "0"],
     ["argument --packs-per-shard: 0 is below 1, the least it can be"]),
    (["data", "pack", "--input", "raw", "--output", "p", "--recipe", "demo", "--max-len", "0"],
     ["argument --max-len: 0 is below 1"]),
    (["data", "convert", "--input", "x.jsonl", "--output", "raw", "--workers", "zero"],
     ["argument --workers: 'zero' is not a whole number"]),
    (["train"], ["name a recipe: a YAML path or a built-in recipe (--list shows them)"]),
])
def test_ordinary_mistakes_are_one_line_and_exit_2(tmp_path, argv, fragments):
    assert_one_line_error(omniweave(*argv, cwd=tmp_path), *fragments)


def test_bad_resume_path_is_one_line(demo_packed, tmp_path):
    r = omniweave("train", "demo", f"data.path={demo_packed}", "data.max_len=512", "--resume", "nowhere", cwd=tmp_path)
    assert_one_line_error(r, "--resume nowhere", "no complete checkpoint")


def test_a_rank_side_user_error_under_nproc_is_printed_once(demo_packed, tmp_path):
    """The packs were built at 512 tokens and the recipe says 1024: found inside the ranks."""
    r = omniweave("train", "demo", "--nproc", "2", f"data.path={demo_packed}", f"output_dir={tmp_path / 'run'}",
                  cwd=tmp_path)
    assert_one_line_error(r, "built with different data settings", "data.max_len: packed with 512, now 1024")
    assert "ChildFailedError" not in r.stderr


def test_debug_shows_the_traceback(tmp_path):
    r = omniweave("train", "demo", "train.step=3", "--debug", cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" in r.stderr and "RecipeError" in r.stderr


def test_inspect_piped_into_head_ends_quietly(demo_packed):
    raw = demo_packed.parent / "raw"
    r = subprocess.run(f"'{sys.executable}' -m omniweave data inspect '{raw}' --show 100 | head -n 1",
                       shell=True, capture_output=True, text=True, env=child_env(), executable="/bin/bash")
    assert r.stdout.startswith("raw dataset") and r.stderr == "", r.stderr


def test_hf_export_refuses_a_folder_that_is_not_empty_unless_forced(demo_packed, tmp_path):
    """An export never mixes its files with a user's silently (issue 31, item 11); with --force it
    writes into the folder and lists only what it wrote."""
    from train_factory import train_in_process

    run = tmp_path / "run"
    train_in_process(demo_packed, run, steps=1)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    r = omniweave("hf", "export", str(run), "--output", str(out), cwd=tmp_path)
    assert_one_line_error(r, f"--output {out} is not empty (notes.txt)", "--force")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    r = omniweave("hf", "export", str(run), "--output", str(out), "--force", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("exported"))
    assert "config.json" in line and "notes.txt" not in line and "; left as they were: 1 other file(s) already there" in line
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("override, message", [
    ("parallel.cp=3", "world size 2 is not divisible by cp*tp = 3"),
    ("train.global_batch=3", "train.global_batch=3 must be a positive multiple of the data-parallel size 2"),
])
def test_a_layout_or_batch_that_does_not_fit_the_ranks_is_one_line(demo_packed, tmp_path, override, message):
    """Found inside the ranks (issue 31, item 11): printed once, as one line, no traceback."""
    r = omniweave("train", "demo", "--nproc", "2", f"data.path={demo_packed}", "data.max_len=512",
                  f"output_dir={tmp_path / 'run'}", override, cwd=tmp_path)
    assert_one_line_error(r, message)
    assert "ChildFailedError" not in r.stderr
