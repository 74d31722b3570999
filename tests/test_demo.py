"""The demo: blanked-media control data keeps every shape but no content; the whole pipeline
(generate -> convert -> pack -> train -> eval -> control) writes its report."""

import io
import json

import av
import numpy as np
import pytest
from PIL import Image

from omniweave.cli import main
from omniweave.data.demo import generate
from omniweave.demo import blank_media_copy


def _frames(data: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(data)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


def test_blanked_media_keep_size_and_frame_count_but_carry_no_content(tmp_path):
    generate(tmp_path / "data", samples=30, eval_samples=10, seed=0)
    n = blank_media_copy(tmp_path / "data", tmp_path / "control")
    media = sorted(p for p in (tmp_path / "data" / "media").rglob("*") if p.is_file())
    assert n == len(media) and n > 0
    assert (tmp_path / "control" / "train.jsonl").read_text() == (tmp_path / "data" / "train.jsonl").read_text()
    kinds = set()
    for src in media:
        dst = tmp_path / "control" / "media" / src.relative_to(tmp_path / "data" / "media")
        if src.suffix == ".png":
            kinds.add("image")
            a, b = Image.open(src), np.asarray(Image.open(dst).convert("RGB"))
            assert b.shape[:2] == (a.size[1], a.size[0]) and b.min() == b.max() == 128
        else:
            kinds.add("video")
            fa, fb = _frames(src.read_bytes()), _frames(dst.read_bytes())
            assert len(fa) == len(fb) and fa[0].shape == fb[0].shape
            assert all(abs(int(f.mean()) - 128) <= 2 and int(f.max()) - int(f.min()) <= 4 for f in fb)
    assert kinds == {"image", "video"}


@pytest.mark.slow
def test_demo_command_runs_the_whole_pipeline_and_writes_its_report(tmp_path):
    out = tmp_path / "demo"
    code = main(["demo", "--out", str(out), "--samples", "120", "--eval-samples", "14", "--steps", "3",
                 "--workers", "1", "train.save_interval=0", "train.log_interval=1"])
    assert code == 0
    report = json.loads((out / "demo_report.json").read_text())
    assert report["steps"] == 3 and report["eval_samples"] == 14 and report["seconds"] > 0
    assert 0.0 <= report["accuracy"] <= 1.0 and 0.0 <= report["control_accuracy"] <= 1.0
    assert report["platform"]["cpu_capability"] and report["platform"]["threads"] == 1  # the recipe's cpu_threads
    run = out / "run"
    assert report["run_dir"] == str(run)
    assert (out / "packed" / "manifest.json").exists() and (run / "loss.png").exists()
    assert [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert (run / "checkpoints" / "latest").resolve().name == "step_000003"
    assert (out / "control" / "run" / "checkpoints" / "latest").exists()


@pytest.mark.slow
def test_packs_and_losses_do_not_depend_on_workers_threads_or_hash_seed(demo_packed, tmp_path):
    """What docs/benchmarks.md promises for the demo on one machine: packing with 2 workers writes
    the bytes 1 worker wrote, and training on 1 or 2 intra-op threads, under different
    PYTHONHASHSEEDs, gives bit-identical losses (only another CPU / SIMD path changes them)."""
    from tests.train_factory import MAX_LEN, child_env, losses, train_subprocess

    again = tmp_path / "packed2"
    assert main(["data", "pack", "--input", str(demo_packed.parent / "raw"), "--output", str(again), "--recipe",
                 "demo", "--max-len", str(MAX_LEN), "--workers", "2"]) == 0
    written = sorted(p.name for p in demo_packed.glob("packs-*")) + ["manifest.json"]
    assert len(written) > 1
    for name in written:
        assert (again / name).read_bytes() == (demo_packed / name).read_bytes(), name
    runs = []
    for threads, hash_seed in ((1, "1"), (2, "2")):
        out = tmp_path / f"run_t{threads}"
        proc = train_subprocess(demo_packed, out, steps=3, env=child_env(PYTHONHASHSEED=hash_seed),
                                train__cpu_threads=threads)
        assert proc.returncode == 0, proc.stdout[-3000:]
        runs.append(losses(out))
    assert len(runs[0]) == 3 and runs[0] == runs[1]


@pytest.mark.slow
def test_rl_demo_runs_sft_then_grpo_and_writes_its_report(tmp_path):
    out = tmp_path / "demo_rl"
    code = main(["demo", "--rl", "--out", str(out), "--samples", "120", "--eval-samples", "14", "--rl-samples", "24",
                 "--sft-steps", "3", "--steps", "2", "--workers", "1", "train.global_batch=4", "rl.group_size=2"])
    assert code == 0
    report = json.loads((out / "rl_report.json").read_text())
    assert report["steps"] == 2 and report["sft_steps"] == 3 and report["seconds"] > 0 and report["engine"] == "native"
    assert 0.0 <= report["accuracy_sft"] <= 1.0 and 0.0 <= report["accuracy_rl"] <= 1.0
    assert report["eval_samples"] == 12  # the eval split's visual questions (14 minus the 2 "add" ones)
    assert set(report["accuracy_by_task_rl"]) <= {"color", "shape", "position", "count", "motion", "which_red"}
    rows = [json.loads(line) for line in (out / "rl" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("reward_mean" in r for r in rows)


@pytest.mark.slow
def test_vla_demo_runs_both_stages_and_writes_its_report(tmp_path):
    """omniweave demo --vla at toy sizes: the vision pretraining stage (demo recipe's backbone, HF
    export), the VLA stage initialised from it, and the closed-loop report with its four measures
    and the pretraining's held-out slot accuracy in [0, 1]."""
    out = tmp_path / "vla"
    code = main(["demo", "--vla", "--out", str(out), "--steps", "2", "--vla-vision-steps", "2",
                 "--vla-episodes", "10", "--vla-eval-episodes", "3", "--workers", "1", "train.save_interval=0"])
    assert code == 0
    report = json.loads((out / "vla_report.json").read_text())
    assert report["steps"] == 2 and report["vision_steps"] == 2 and report["eval_episodes"] == 3
    assert "seconds" in report and report["seconds"] > 0  # the whole demo's wall time (rounded to 0.1 s)
    for key in ("success_rate", "control_success_rate", "wrong_instruction_success_rate", "random_success_rate",
                "vision_slot_accuracy"):
        assert 0.0 <= report[key] <= 1.0
    assert (out / "vision" / "hf" / "config.json").exists()
    assert len((out / "run" / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow
def test_diffusion_demo_runs_every_stage_and_writes_its_report(tmp_path):
    """omniweave demo --diffusion at toy sizes: clips, the VAE fit (a diffusers folder the recipe
    loads), convert, pack, train, the three sampled prompt sets read by the checker, the report
    with its accuracies in [0, 1] and the frame grid / GIF."""
    out = tmp_path / "diffusion"
    code = main(["demo", "--diffusion", "--out", str(out), "--steps", "2", "--diffusion-clips", "24",
                 "--diffusion-vae-steps", "2", "--diffusion-sample-steps", "2", "--diffusion-eval-per-pair", "1",
                 "--workers", "1"])
    assert code == 0
    report = json.loads((out / "diffusion_report.json").read_text())
    assert report["steps"] == 2 and report["clips"] == 24 and report["vae"]["steps"] == 2
    for key in ("prompt_accuracy", "seen_prompt_accuracy", "control_prompt_accuracy", "colour_accuracy",
                "direction_accuracy"):
        assert 0.0 <= report[key] <= 1.0
    assert report["details"]["held"]["n"] == 4 and report["details"]["seen"]["n"] == 12
    assert (out / "vae" / "config.json").exists() and (out / "samples.png").exists() and (out / "samples.gif").exists()
    assert len((out / "run" / "metrics.jsonl").read_text().splitlines()) >= 1
