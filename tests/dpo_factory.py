"""Shared pieces of the DPO tests: the demo's preference pairs converted and packed with the
demo_dpo recipe (small packs), and recipe overrides for short runs on them."""

from __future__ import annotations

from pathlib import Path

from omniweave.cli import main as cli

MAX_LEN = 256


def make_pairs(root: Path, pairs: int = 48, max_len: int = MAX_LEN, recipe: str = "demo_dpo",
               overrides: tuple[str, ...] = ()) -> Path:
    """``data demo`` pairs -> convert -> pack (``recipe`` + ``overrides``): every task, images and a video among them."""
    root = Path(root)
    assert cli(["data", "demo", str(root / "demo"), "--samples", "0", "--eval-samples", "0", "--rl-samples", "0",
                "--dpo-samples", str(pairs)]) == 0
    assert cli(["data", "convert", "--input", str(root / "demo" / "dpo.jsonl"), "--media-dir",
                str(root / "demo" / "media"), "--output", str(root / "raw"), "--workers", "1", "--no-progress"]) == 0
    assert cli(["data", "pack", "--input", str(root / "raw"), "--output", str(root / "pairs"), "--recipe", recipe,
                "--max-len", str(max_len), "--workers", "1", *overrides]) == 0
    return root / "pairs"


def dpo_overrides(pairs: Path, out: Path, steps: int = 2, global_batch: int = 2, **kw) -> list[str]:
    ov = {"output_dir": out, "data.path": pairs, "data.max_len": MAX_LEN, "train.steps": steps,
          "train.global_batch": global_batch, "train.warmup": 0, "train.save_interval": 0, "train.log_interval": 1,
          "train.cpu_threads": 1}
    ov.update({k.replace("__", "."): v for k, v in kw.items()})
    return [f"{k}={v}" for k, v in ov.items()]


def make_kto(root: Path, completions: int = 32, max_len: int = MAX_LEN) -> Path:
    """``data demo`` KTO completions (half desirable) -> convert -> pack (demo_kto): images, a
    video and text-only rows among them; each pack holds its completions and their KL documents."""
    root = Path(root)
    assert cli(["data", "demo", str(root / "demo"), "--samples", "0", "--eval-samples", "0", "--rl-samples", "0",
                "--dpo-samples", "0", "--kto-samples", str(completions)]) == 0
    assert cli(["data", "convert", "--input", str(root / "demo" / "kto.jsonl"), "--media-dir",
                str(root / "demo" / "media"), "--output", str(root / "raw"), "--workers", "1", "--no-progress"]) == 0
    assert cli(["data", "pack", "--input", str(root / "raw"), "--output", str(root / "completions"), "--recipe",
                "demo_kto", "--max-len", str(max_len), "--workers", "1"]) == 0
    return root / "completions"
