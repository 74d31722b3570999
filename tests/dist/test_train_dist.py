"""Multi-process training (gloo, torchrun via ``omniweave train --nproc N``) against the
single-process run of the same recipe and data (DESIGN.md §4):

- data parallel: 2 and 4 ranks, and 2 ranks with gradient accumulation, give the 1-rank losses
  and final weights;
- resume: a run SIGKILLed mid-training, or killed inside a checkpoint write, and resumed with
  ``--resume auto`` reproduces the uninterrupted losses; a 1-rank checkpoint resumes on 2 ranks;
- pipeline parallelism: pp 2 (1f1b; interleaved x virtual 2; x dp 2, x foundation tp 2, x cp 2)
  gives the 1-rank losses, grad norms and weights, and its checkpoints resume on 1 rank and at
  pp 4 (and a 1-rank one at pp 2);
- a rank whose pack has no media next to a rank with a video does not hang.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch

from tests.train_factory import (
    child_env, final_state, losses, max_abs_diff, pack_jsonl, read_metrics, train_cmd, train_subprocess,
)

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS, SAVE = 6, 2
LOSS_RTOL = 1e-5  # per-step loss, relative, any DP layout vs 1 rank (measured ~1e-7)
WEIGHT_ATOL = 1e-5  # every tensor of the final checkpoint, max |Δ| (measured ~1e-7)
# CP / TP change the order of many more sums (attention merges, vocab-parallel loss); AdamW divides
# by sqrt(v), so parameters whose gradients are ~0 (k_proj.bias: exactly 0 in exact arithmetic;
# patch-embedding rows that see constant synthetic pixels) turn that fp32 noise into updates of up
# to ~lr per step. Gradients themselves are compared at 1e-5 in test_layout_parity.py.
LAYOUT_WEIGHT_ATOL = 3e-5
# pp 2 x cp 2 after 6 steps: 3.1e-5 at one LM-head weight whose step-1 gradient equals the 1-rank one within
# 2e-6 relative (tests/dist/test_pipeline.py compares every gradient at 1e-5); AdamW's noise, as above
PP_CP_WEIGHT_ATOL = 5e-5
# pp 2 x foundation tp 2: 5.6e-5 on this project's 2-core machines (the same at 936b481, before HSDP;
# CI's machine gave less), losses and grad norms within 1e-5 of one rank: AdamW's noise, as above
PP_TP_WEIGHT_ATOL = 1e-4

_RUNS: dict = {}


def _run(demo_packed, tmp_path_factory, nproc: int, gb: int = 4, steps: int = STEPS, recipe: str = "demo", **kw):
    """A finished run (cached per session/worker): checkpoints every 2 steps, all kept."""
    key = (recipe, nproc, gb, steps, tuple(sorted(kw.items())))
    if key not in _RUNS:
        out = tmp_path_factory.mktemp(f"n{nproc}_gb{gb}") / "run"
        res = train_subprocess(demo_packed, out, nproc=nproc, steps=steps, global_batch=gb, recipe=recipe,
                               train__save_interval=SAVE, train__keep_last=0, **kw)
        assert res.returncode == 0, res.stdout[-4000:]
        (out / "stdout.txt").write_text(res.stdout)
        _RUNS[key] = out
    return _RUNS[key]


def _run_dir_at(finished, step: int, run):
    """A run directory as ``finished`` was at ``step``: that checkpoint and the metrics up to it
    (what ``--resume auto`` continues from)."""
    (run / "checkpoints").mkdir(parents=True)
    name = f"step_{step:06d}"
    shutil.copytree(finished / "checkpoints" / name, run / "checkpoints" / name)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in read_metrics(finished)[:step]))
    return run


def _assert_same_losses(got: list[float], want: list[float], rtol: float) -> float:
    assert len(got) == len(want), (got, want)
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    assert rel <= rtol, (got, want)
    return rel


# ---------------------------------------------------------------------------- data parallel


@pytest.mark.parametrize("nproc,gb,steps", [(2, 4, STEPS), (4, 4, STEPS), (2, 8, 3)],
                         ids=["2ranks", "4ranks", "2ranks-accum4"])
def test_data_parallel_equals_single_process(demo_packed, tmp_path_factory, nproc, gb, steps):
    """Same global batch on N ranks (gb 8 on 2 ranks = 4 micro-batches per rank): same losses, same weights."""
    ref, run = (_run(demo_packed, tmp_path_factory, n, gb, steps) for n in (1, nproc))
    rel = _assert_same_losses(losses(run), losses(ref), LOSS_RTOL)
    tokens = [r["tokens"] for r in read_metrics(run)]
    assert tokens == [r["tokens"] for r in read_metrics(ref)]  # every rank's packs counted once
    dw = max_abs_diff(final_state(run), final_state(ref))
    assert dw <= WEIGHT_ATOL
    print(f"dp={nproc} gb={gb}: loss max rel Δ {rel:.2e}, weights max |Δ| {dw:.2e}")


@pytest.mark.parametrize("nproc,parallel", [
    (2, {"parallel__cp": 2}),
    (4, {"parallel__cp": 2, "parallel__cp_attention": "ulysses", "parallel__vision_split": False}),
    (2, {"model__foundation__tp": 2, "model__image_encoder__tp": 1, "train__save_hf": True}),
    (4, {"parallel__cp": 2, "model__foundation__tp": 2, "model__image_encoder__tp": 2}),
    (2, {"data__balance": "cost", "data__balance_refit": 2}),
], ids=["cp2-ring", "dp2xcp2-ulysses", "tp2-encoder-tp1", "cp2xtp2", "dp2-balanced-refit"])
def test_parallel_layouts_train_like_single_process(demo_packed, tmp_path_factory, nproc, parallel):
    """`omniweave train --nproc N` with CP, per-component TP (the encoder's tp replicas splitting
    the media), both together, and cost-balanced DP with a refit after 2 steps (other packs per
    rank, same global batch): the 1-rank losses, token counts and final weights."""
    ref = _run(demo_packed, tmp_path_factory, 1)
    run = _run(demo_packed, tmp_path_factory, nproc, **parallel)
    rel = _assert_same_losses(losses(run), losses(ref), LOSS_RTOL)
    assert [r["tokens"] for r in read_metrics(run)] == [r["tokens"] for r in read_metrics(ref)]
    gnorm_rel = max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(read_metrics(run), read_metrics(ref)))
    assert gnorm_rel <= LOSS_RTOL  # a component's gradients off by a factor would show here (AdamW hides it)
    dw = max_abs_diff(final_state(run), final_state(ref))
    assert dw <= LAYOUT_WEIGHT_ATOL
    if parallel.get("data__balance"):  # every step logs the predicted imbalance, balanced <= contiguous
        rows = read_metrics(run)
        assert all(r["imbalance_after"] <= r["imbalance_before"] for r in rows), rows
        assert "cost model refitted from 2 steps" in (run / "stdout.txt").read_text()
    if parallel.get("train__save_hf"):  # the sharded (TP + FSDP) model gathers into a HF export
        assert (run / "hf" / "config.json").exists() and list((run / "hf").glob("*.safetensors"))
    print(f"{nproc} ranks {parallel}: loss max rel Δ {rel:.2e}, grad-norm {gnorm_rel:.2e}, weights max |Δ| {dw:.2e}")


@pytest.mark.parametrize("nproc,parallel", [
    (2, {"parallel__pp": 2}),
    (2, {"parallel__pp": 2, "parallel__pp_schedule": "interleaved_1f1b", "parallel__pp_virtual": 2}),
    (4, {"parallel__pp": 2}),
    (4, {"parallel__pp": 2, "parallel__pp_schedule": "interleaved_1f1b", "parallel__pp_virtual": 2,
         "train__global_batch": 8}),
    (4, {"parallel__pp": 2, "model__foundation__tp": 2, "weight_atol": PP_TP_WEIGHT_ATOL}),
    (4, {"parallel__pp": 2, "parallel__cp": 2, "weight_atol": PP_CP_WEIGHT_ATOL}),
    (2, {"parallel__pp": 2, "parallel__pp_schedule": "gpipe", "parallel__seq_chunks": 4}),
    (4, {"parallel__pp": 2, "parallel__pp_schedule": "gpipe", "parallel__seq_chunks": 4}),
], ids=["pp2-1f1b", "pp2xv2-interleaved", "pp2xdp2", "pp2xv2xdp2-interleaved", "pp2xtp2", "pp2xcp2-ring",
        "pp2-seq_chunks4", "pp2xdp2-seq_chunks4"])
def test_pipeline_trains_like_single_process(demo_packed, tmp_path_factory, nproc, parallel):
    """`omniweave train --nproc N parallel.pp=2` (the demo foundation at 4 layers; 4 rows per step
    = 4 micro-batches per pipeline, 2 each under dp 2, padded to data.max_len; under dp 2 each
    pipeline's parts FSDP-sharded over the ranks holding the same stages; with the foundation at
    tp 2 over the encoder at tp 1, and with cp 2, each (cp, tp) rank a pipeline of its own, the
    rows CP-sharded at one static length): the 1-rank losses,
    token counts and grad norms (summed over the stages' ranks), and its checkpoints (each rank
    saves its stages' weights) load into one plain process with the 1-rank final weights."""
    layers = {"model__foundation__num_layers": 4}
    parallel = dict(parallel)
    gb = parallel.pop("train__global_batch", 4)  # interleaved under dp 2: 4 rows per pipeline
    weight_atol = parallel.pop("weight_atol", LAYOUT_WEIGHT_ATOL)
    ref = _run(demo_packed, tmp_path_factory, 1, gb, **layers)
    run = _run(demo_packed, tmp_path_factory, nproc, gb, **layers, **parallel)
    rel = _assert_same_losses(losses(run), losses(ref), LOSS_RTOL)
    assert [r["tokens"] for r in read_metrics(run)] == [r["tokens"] for r in read_metrics(ref)]
    gnorm_rel = max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(read_metrics(run), read_metrics(ref)))
    assert gnorm_rel <= LOSS_RTOL
    dw = max_abs_diff(final_state(run), final_state(ref))
    assert dw <= weight_atol
    print(f"pp {parallel}: loss max rel Δ {rel:.2e}, grad-norm {gnorm_rel:.2e}, weights max |Δ| {dw:.2e}")


MOE = {"model__foundation__num_layers": 4, "model__foundation__mlp_only_layers": "[2,3]",
       "model__foundation__router_z_loss_coef": 0.001}


@pytest.mark.parametrize("nproc, level, ep", [(2, "global", 1), (4, "sequence", 2)],
                         ids=["pp2-global_aux", "pp2xdp2xep2-sequence_aux"])
def test_pipeline_trains_moe_like_single_process(demo_packed, tmp_path_factory, nproc, level, ep):
    """``demo_moe`` (Qwen3-MoE, top-2 of 8) at 4 layers, layers 2 and 3 dense, so that stage 1
    holds no MoE layer: pp 2 (the micro-step-global balance loss) and pp 2 x dp 2 (the
    sequence-wise one, layout independent) with each stage's experts split over its 2
    data-parallel ranks (ep 2: the all-to-alls run between the ranks holding the same stage)
    give the 1-rank losses, grad norms, final weights and router metrics. The router losses ride in the stages' backward (``attach_loss``); their scales
    count the whole model's MoE layers, and every rank reports every stage's router statistics."""
    moe = {**MOE, "model__foundation__aux_loss_level": level}
    ref = _run(demo_packed, tmp_path_factory, 1, recipe="demo_moe", **moe)
    run = _run(demo_packed, tmp_path_factory, nproc, recipe="demo_moe", parallel__pp=2, parallel__ep=ep, **moe)
    rel = _assert_same_losses(losses(run), losses(ref), LOSS_RTOL)
    for key in ("grad_norm", "moe_aux_loss", "moe_z_loss", "moe_load_max_mean"):
        got, want = [r[key] for r in read_metrics(run)], [r[key] for r in read_metrics(ref)]
        assert got == pytest.approx(want, rel=LOSS_RTOL), key
    dw = max_abs_diff(final_state(run), final_state(ref))
    assert dw <= LAYOUT_WEIGHT_ATOL
    assert all(("moe_a2a_bytes" in r) == (ep > 1) for r in read_metrics(run))  # the experts' tokens did travel
    print(f"moe pp2 nproc {nproc} ep {ep} {level}: loss max rel Δ {rel:.2e}, weights max |Δ| {dw:.2e}")


LORA = "{r: 4, alpha: 8, targets: all-linear}"


def test_pipeline_trains_lora_adapters_like_single_process(demo_packed, tmp_path_factory):
    """LoRA on every Linear of the foundation and the vision tower, the projector in full, the
    rest frozen: pp 2 x foundation tp 2 (the adapters placed after their TP weights, each stage
    holding its layers') gives the 1-rank losses, grad norms and final weights; the frozen base
    weights stay as initialised."""
    nproc, parallel = 4, {"parallel__pp": 2, "model__foundation__tp": 2}
    lora = {"+model__foundation__lora": LORA, "+model__image_encoder__lora": LORA, "model__foundation__num_layers": 4}
    ref = _run(demo_packed, tmp_path_factory, 1, **lora)
    run = _run(demo_packed, tmp_path_factory, nproc, **lora, **parallel)
    rel = _assert_same_losses(losses(run), losses(ref), LOSS_RTOL)
    gnorm_rel = max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(read_metrics(run), read_metrics(ref)))
    assert gnorm_rel <= LOSS_RTOL
    final, first = final_state(run), final_state(run / "checkpoints" / f"step_{SAVE:06d}")
    dw = max_abs_diff(final, final_state(ref))
    assert dw <= LAYOUT_WEIGHT_ATOL
    base = [k for k in final if "lora_" not in k and ("foundation.layers" in k or "image_encoder" in k)]
    assert base and all(torch.equal(final[k], first[k]) for k in base)
    print(f"lora {parallel}: loss max rel Δ {rel:.2e}, grad-norm {gnorm_rel:.2e}, weights max |Δ| {dw:.2e}")


def test_pipeline_exports_and_evaluates_the_whole_model(demo_packed, tmp_path_factory):
    """pp 2 x dp 2 with ``train.save_hf`` and ``train.eval_interval``: rank 0 gathers its pipeline's
    stage parts (each whole over its FSDP shards) into one model, so the HF export holds every tensor
    of the run's final checkpoint, equal, and the eval at the last step scores that model as an
    eval of the checkpoint in one plain process does."""
    from omegaconf import OmegaConf

    from omniweave.models.hf.loading import load_hf_into
    from omniweave.train.checkpoint import load_model
    from omniweave.train.evaluate import eval_fn

    eval_path = demo_packed.parent / "demo" / "eval.jsonl"
    run = _run(demo_packed, tmp_path_factory, 4, model__foundation__num_layers=4, parallel__pp=2,
               train__save_hf=True, train__eval_interval=3, eval__path=eval_path)
    final = final_state(run)
    exported, model_cfg = load_model(run)
    load_hf_into(exported, str(run / "hf"))
    assert max_abs_diff({k: v for k, v in exported.state_dict().items()}, final) == 0.0
    records = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3, STEPS] and records[-1]["eval_n"] == 8
    cfg = OmegaConf.load(run / "config.yaml")
    plain, _ = load_model(run)
    assert eval_fn(plain.eval(), cfg, STEPS) == {k: v for k, v in records[-1].items() if k != "step"}


@pytest.mark.parametrize("nproc,parallel", [(2, {}), (2, {"parallel__cp": 2})], ids=["dp2", "cp2-audio-split"])
def test_omni_training_with_audio_matches_single_process(omni_packed, tmp_path_factory, nproc, parallel):
    """convert -> pack -> train on mixed text / image / video / audio data (``demo_omni``: the demo
    model plus an audio tower by YAML): dp 2, and cp 2 with the audio items split over the CP ranks,
    give the 1-rank losses, grad norms and final weights."""
    ref = _run(omni_packed, tmp_path_factory, 1, recipe="demo_omni")
    run = _run(omni_packed, tmp_path_factory, nproc, recipe="demo_omni", **parallel)
    rel = _assert_same_losses(losses(run), losses(ref), LOSS_RTOL)
    gnorm_rel = max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(read_metrics(run), read_metrics(ref)))
    assert gnorm_rel <= LOSS_RTOL
    state, ref_state = final_state(run), final_state(ref)
    first = final_state(ref / "checkpoints" / f"step_{SAVE:06d}")
    tower = [k for k in ref_state if k.startswith("audio_encoder.")]
    assert tower and any(not torch.equal(ref_state[k], first[k]) for k in tower)  # the audio tower trains
    dw = max_abs_diff(state, ref_state)
    assert dw <= LAYOUT_WEIGHT_ATOL
    print(f"omni {nproc} ranks {parallel}: loss max rel Δ {rel:.2e}, grad-norm {gnorm_rel:.2e}, weights max |Δ| {dw:.2e}")


# ---------------------------------------------------------------------------- resume


def _wait_for_step(run, step: int, proc: subprocess.Popen, timeout: float = 240) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = read_metrics(run) if (run / "metrics.jsonl").exists() else []
        if rows and rows[-1]["step"] >= step:
            return rows[-1]["step"]
        assert proc.poll() is None, f"the run exited (rc {proc.returncode}) before step {step}"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"no step {step} within {timeout} s")


def test_sigkill_mid_training_then_resume_auto_equals_uninterrupted(demo_packed, tmp_path_factory, tmp_path):
    ref = _run(demo_packed, tmp_path_factory, 1)
    run = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(demo_packed, run, steps=STEPS, train__save_interval=SAVE, train__keep_last=0),
                            env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    seen = _wait_for_step(run, SAVE + 1, proc)  # a step past the first checkpoint
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert seen < STEPS, "the run finished before it could be killed"
    killed_at = read_metrics(run)[-1]["step"]
    res = train_subprocess(demo_packed, run, resume="auto", steps=STEPS, train__save_interval=SAVE, train__keep_last=0)
    assert res.returncode == 0, res.stdout[-4000:]
    assert "resumed from" in res.stdout
    assert [r["step"] for r in read_metrics(run)] == list(range(1, STEPS + 1))  # redone steps are not duplicated
    assert losses(run) == losses(ref), (killed_at, losses(run), losses(ref))  # bit-identical
    assert max_abs_diff(final_state(run), final_state(ref)) == 0.0


def test_kill_inside_checkpoint_write_leaves_previous_checkpoint_and_resumes(demo_packed, tmp_path_factory, tmp_path):
    """2 ranks; rank 0 dies after the step-4 shards are written but before the rename."""
    ref = _run(demo_packed, tmp_path_factory, 2)
    run = tmp_path / "run"
    kw = dict(nproc=2, steps=STEPS, train__save_interval=SAVE, train__keep_last=0)
    res = train_subprocess(demo_packed, run, env=child_env(OMNIWEAVE_FAULT_IN_SAVE="4"), **kw)
    assert res.returncode != 0
    ckpts = run / "checkpoints"
    assert (ckpts / ".tmp-step_000004" / ".metadata").exists()  # shards were written...
    assert not (ckpts / "step_000004").exists()  # ...but never published
    assert (ckpts / "latest").resolve().name == "step_000002"
    res = train_subprocess(demo_packed, run, resume="auto", **kw)
    assert res.returncode == 0, res.stdout[-4000:]
    assert "step_000002 at step 2" in res.stdout
    assert not list(ckpts.glob(".tmp-*"))
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000002", "step_000004", "step_000006"]
    assert losses(run) == losses(ref)
    assert max_abs_diff(final_state(run), final_state(ref)) == 0.0


def test_one_rank_checkpoint_resumes_on_two_ranks(demo_packed, tmp_path_factory, tmp_path):
    """DCP reshards a 1-rank checkpoint onto 2 FSDP ranks; the rest of the run matches 1 rank."""
    ref = _run(demo_packed, tmp_path_factory, 1)
    run = _run_dir_at(ref, 2, tmp_path / "run")
    res = train_subprocess(demo_packed, run, nproc=2, resume="auto", steps=STEPS, train__save_interval=SAVE,
                           train__keep_last=0)
    assert res.returncode == 0, res.stdout[-4000:]
    _assert_same_losses(losses(run), losses(ref), LOSS_RTOL)
    assert max_abs_diff(final_state(run), final_state(ref)) <= WEIGHT_ATOL


@pytest.mark.parametrize("nproc, parallel", [(1, {}), (2, {}), (2, {"parallel__pp": 2, "train__ac": "full"})],
                         ids=["1rank", "dp2", "pp2-ac_full"])
def test_optimizer_offload_trains_and_resumes_like_without(demo_packed, tmp_path_factory, tmp_path, nproc, parallel):
    """``train.offload: optimizer`` (FSDP2's CPU offload policy, on one rank and on each stage's one
    rank too, there with activation checkpointing of every block): the 1-rank losses and final
    weights; its step-4 checkpoint resumed (offloaded again) finishes the same way."""
    ref = _run(demo_packed, tmp_path_factory, 1)
    run = _run(demo_packed, tmp_path_factory, nproc, train__offload="optimizer", **parallel)
    assert "weights + optimizer state offloaded to host memory" in (run / "stdout.txt").read_text()
    rel = _assert_same_losses(losses(run), losses(ref), LOSS_RTOL)
    dw = max_abs_diff(final_state(run), final_state(ref))
    assert dw <= WEIGHT_ATOL
    resumed = _run_dir_at(run, 4, tmp_path / "run")
    res = train_subprocess(demo_packed, resumed, nproc=nproc, resume="auto", steps=STEPS, train__save_interval=SAVE,
                           train__keep_last=0, train__offload="optimizer", **parallel)
    assert res.returncode == 0, res.stdout[-4000:]
    _assert_same_losses(losses(resumed), losses(ref), LOSS_RTOL)
    assert max_abs_diff(final_state(resumed), final_state(ref)) <= WEIGHT_ATOL
    print(f"offload {nproc} rank(s): loss max rel Δ {rel:.2e}, weights max |Δ| {dw:.2e}")


@pytest.mark.parametrize("saved_on, resumed_on", [(1, 2), (2, 1), (2, 4)],
                         ids=["1rank-to-pp2", "pp2-to-1rank", "pp2-to-pp4"])
def test_pipeline_checkpoints_resume_at_another_layout(demo_packed, tmp_path_factory, tmp_path, saved_on, resumed_on):
    """A step-2 checkpoint of one layout (1 rank, or pp 2: each rank saved its stages' weights and
    AdamW moments under the model's names) resumed on another (1 rank, pp 2, pp 4: one layer a
    stage): the rest of the run matches 1 rank."""
    layers = {"model__foundation__num_layers": 4}
    pp = {1: {}, 2: {"parallel__pp": 2}, 4: {"parallel__pp": 4}}
    ref = _run(demo_packed, tmp_path_factory, 1, **layers)
    saved = _run(demo_packed, tmp_path_factory, saved_on, **layers, **pp[saved_on])
    run = _run_dir_at(saved, 2, tmp_path / "run")
    res = train_subprocess(demo_packed, run, nproc=resumed_on, resume="auto", steps=STEPS, train__save_interval=SAVE,
                           train__keep_last=0, **layers, **pp[resumed_on])
    assert res.returncode == 0, res.stdout[-4000:]
    assert "resumed from" in res.stdout
    rel = _assert_same_losses(losses(run), losses(ref), LOSS_RTOL)
    dw = max_abs_diff(final_state(run), final_state(ref))
    assert dw <= LAYOUT_WEIGHT_ATOL
    print(f"checkpoint of {saved_on} -> {resumed_on} ranks: loss max rel Δ {rel:.2e}, weights max |Δ| {dw:.2e}")


# ---------------------------------------------------------------------------- media imbalance


SMALL_LEN = 256  # ~1-3 documents a pack


def _text_and_video_packs(root, demo_dir):
    """Packed data whose packs are text-only or video-only (sequential packing of sorted rows)."""
    rows = [json.loads(ln) for ln in (demo_dir / "train.jsonl").read_text().splitlines()]
    text = [r for r in rows if not r["images"] and not r["videos"]]
    video = [r for r in rows if r["videos"] and not r["images"]]
    jsonl = root / "mixed.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in text + video))
    return pack_jsonl(jsonl, demo_dir / "media", root, SMALL_LEN, "--algorithm", "sequential")


def test_text_only_rank_next_to_video_rank_does_not_hang(demo_packed, tmp_path):
    from omniweave.data.loading.loader import PackedLoader
    from omniweave.data.packing.packed import PackedDataset

    packed = _text_and_video_packs(tmp_path, demo_packed.parent / "demo")
    ds = PackedDataset(packed)
    kinds = [{m["kind"] for m in ds[i]["media"]} for i in range(len(ds))]
    assert set() in kinds and {"video"} in kinds

    def mixes(seed):  # both steps: rank 0 gets a text-only pack, rank 1 a pack with a video
        loader = PackedLoader(packed, 2, 0, 2, seed=seed)
        state = (0, 0)
        for _ in range(2):
            ids, *state = loader.global_batch_ids(*state)
            if kinds[ids[0]] or kinds[ids[1]] != {"video"}:
                return False
        return True

    seed = next(s for s in range(500) if mixes(s))
    res = train_subprocess(packed, tmp_path / "run", nproc=2, timeout=180, steps=2, global_batch=2, train__seed=seed,
                           data__max_len=SMALL_LEN)
    assert res.returncode == 0, res.stdout[-4000:]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) and not r["skipped"] for r in rows)
