"""A checkpoint from a stranger: it cannot run code on the reader, and damaged bytes are named
instead of loaded (omniweave/train/checkpoint_io.py); ``--resume auto`` passes over a damaged
checkpoint to the newest one that verifies."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from omniweave.cli import main as cli
from omniweave.train import checkpoint, checkpoint_io
from train_factory import final_state, max_abs_diff, overrides, read_metrics, train_in_process


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class RunsCode:
    """What a crafted pickle does: unpickling it calls ``os.system``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def saved_run(demo_packed, tmp_path_factory):
    """4 steps, checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("trust") / "run"
    train_in_process(demo_packed, out, steps=4, train__save_interval=2, train__keep_last=0)
    return out


def copy_run(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst, symlinks=True)
    return dst


def rehash(ckpt: Path, name: str) -> None:
    """What an attacker does after editing ``name``: record its new checksum too."""
    sums = json.loads((ckpt / checkpoint_io.CHECKSUMS).read_text())
    data = (ckpt / name).read_bytes()
    sums[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (ckpt / checkpoint_io.CHECKSUMS).write_text(json.dumps(sums))


def test_the_crafted_pickle_runs_code_under_plain_pickle(tmp_path):
    """The control: without the restricted unpickler this file runs its command."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(RunsCode(marker)))
    assert marker.exists()


def test_metadata_that_runs_code_is_refused_by_export_init_from_and_resume(saved_run, demo_packed, tmp_path, capsys):
    run = copy_run(saved_run, tmp_path)
    marker = tmp_path / "ran"
    ckpt = run / "checkpoints" / "step_000004"
    (ckpt / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    rehash(ckpt, ".metadata")

    assert cli(["hf", "export", str(run), "--output", str(tmp_path / "hf")]) == 2
    assert cli(["train", "demo", *overrides(demo_packed, tmp_path / "init", steps=1),
                f"train.init_from={ckpt}"]) == 2
    assert cli(["train", "demo", *overrides(demo_packed, run, steps=6), "--resume", str(ckpt)]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 3, err
    for line in lines:
        assert f"{ckpt}/.metadata: refused to read it — it asks for posix.system" in line
    assert "Traceback" not in err
    assert not marker.exists()


def test_a_value_that_runs_code_is_refused(tmp_path):
    """DCP reads non-tensor values (the optimizer's hyperparameters) with full pickle; ours does not."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": torch.arange(3.0), "lr": RunsCode(marker)}, checkpoint_id=str(tmp_path / "ck"))
    with pytest.raises(checkpoint_io.CheckpointRefused, match="refused to read lr of a checkpoint — it asks for posix.system"):
        with pytest.warns(UserWarning, match="single process"):
            checkpoint_io.dcp_load({"w": torch.zeros(3), "lr": 0.0}, tmp_path / "ck")
    assert not marker.exists()
    with pytest.warns(UserWarning, match="single process"):  # the control: DCP's own reader runs it
        dcp.load({"w": torch.zeros(3), "lr": 0.0}, checkpoint_id=str(tmp_path / "ck"))
    assert marker.exists()


def test_plain_values_still_load(tmp_path):
    state = {"w": torch.arange(3.0), "lr": 3e-4, "betas": (0.9, 0.95), "name": "adamw", "foreach": None}
    with pytest.warns(UserWarning, match="single process"):
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=str(tmp_path / "ck"))
        back = {"w": torch.zeros(3), "lr": 0.0, "betas": (0.0, 0.0), "name": "", "foreach": True}
        checkpoint_io.dcp_load(back, tmp_path / "ck")
    assert torch.equal(back["w"], state["w"]) and {k: back[k] for k in state if k != "w"} == \
        {k: state[k] for k in state if k != "w"}


def test_every_saved_file_has_a_checksum(saved_run):
    ckpt = saved_run / "checkpoints" / "step_000004"
    sums = json.loads((ckpt / checkpoint_io.CHECKSUMS).read_text())
    files = sorted(f.name for f in ckpt.iterdir() if f.name != checkpoint_io.CHECKSUMS)
    assert sorted(sums) == files
    assert {".metadata", "config.yaml", "trainer_state.json", "rng_rank0.pt"} <= set(files)
    assert not list(ckpt.glob(".checksums-rank*"))
    assert checkpoint_io.find_damage(ckpt) is None


def flip_bit(file: Path, at: int = 200) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0x10
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, says", [
    (lambda c: flip_bit(next(c.glob("*.distcp"))), "__0_0.distcp does not match its checksum"),
    (lambda c: os.truncate(next(c.glob("*.distcp")), 100), "__0_0.distcp has 100 bytes"),
    (lambda c: (c / "trainer_state.json").write_text("{garbage"), "trainer_state.json has 8 bytes"),
    (lambda c: (c / "rng_rank0.pt").unlink(), "rng_rank0.pt is missing"),
    (lambda c: (c / checkpoint_io.CHECKSUMS).write_text("{"), "checksums.json is not readable"),
], ids=["bit-flip", "truncated", "garbage-state", "missing", "bad-checksums"])
def test_a_damaged_checkpoint_is_named_not_loaded(saved_run, tmp_path, damage, says, capsys):
    run = copy_run(saved_run, tmp_path)
    ckpt = run / "checkpoints" / "step_000004"
    damage(ckpt)
    with pytest.raises(checkpoint_io.CheckpointDamaged, match=f"checkpoint {ckpt}: .*{says}"):
        checkpoint.load_model(ckpt)
    assert cli(["hf", "export", str(ckpt), "--output", str(tmp_path / "hf")]) == 2
    assert says in capsys.readouterr().err


def test_resume_auto_passes_over_a_damaged_checkpoint(saved_run, demo_packed, tmp_path, capsys):
    """A flipped bit in the newest checkpoint: auto resume says so and continues from the one
    before, exactly as a resume from that one would."""
    run = copy_run(saved_run, tmp_path)
    flip_bit(next((run / "checkpoints" / "step_000004").glob("*.distcp")))
    train_in_process(demo_packed, run, steps=5, resume="auto", train__save_interval=2)
    out = capsys.readouterr().out
    assert "--resume auto: passed over 1 damaged checkpoint(s)" in out and "resuming from step_000002" in out
    assert [m["step"] for m in read_metrics(run)][-3:] == [3, 4, 5]

    clean = copy_run(saved_run, tmp_path / "clean")
    shutil.rmtree(clean / "checkpoints" / "step_000004")
    (clean / "checkpoints" / "latest").unlink()
    train_in_process(demo_packed, clean, steps=5, resume="auto", train__save_interval=2)
    assert max_abs_diff(final_state(run), final_state(clean)) == 0.0


def test_resume_auto_refuses_when_every_checkpoint_is_damaged(saved_run, demo_packed, tmp_path, capsys):
    run = copy_run(saved_run, tmp_path)
    for step in ("step_000002", "step_000004"):
        flip_bit(next((run / "checkpoints" / step).glob("*.distcp")))
    assert cli(["train", "demo", *overrides(demo_packed, run, steps=6), "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert "--resume auto: every checkpoint is damaged" in err and "step_000002" in err and "Traceback" not in err
