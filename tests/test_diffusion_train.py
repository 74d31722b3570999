"""train.phase=diffusion end to end on synthetic moving-shape clips (diffusion/demo_data.py):
``data convert --format clips`` -> ``data pack --recipe tiny_diffusion`` (latents and text states
made offline by the recipe's VAE and text encoder) -> ``omniweave train``.

Checked: a packed clip's latents equal the recipe's VAE + patchify on the same decoded frames, its
text states the text encoder's; clips too short for the recipe are counted drops; packing refuses
the wrong kind of raw data and a run refuses packs made by other codecs, each in one line; the
flow loss falls; a resumed run equals an uninterrupted one bit for bit; two data-parallel ranks
(FSDP2, gloo) equal one process (losses and grad norms within 1e-5 relative)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import torch
import pytest

from omniweave.cli import main as cli
from omniweave.data.packing.packed import PackedDataset
from tests.train_factory import read_metrics, train_in_process, train_subprocess


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict:
    from omniweave.diffusion.demo_data import render_clip, write_clips_dataset, write_mp4

    root = tmp_path_factory.mktemp("diffusion")
    jsonl = write_clips_dataset(root / "clips", num_clips=10, progress=False)
    write_mp4(root / "clips" / "videos" / "short.mp4", render_clip(3, frames=5)[:3], fps=16)  # 3 frames < 17
    with open(jsonl, "a") as f:
        f.write(json.dumps({"id": "short", "video": "videos/short.mp4", "caption": "a red disc moving left"}) + "\n")
    assert cli(["data", "convert", "--format", "clips", "--input", str(jsonl), "--media-dir", str(root / "clips"),
                "--output", str(root / "raw"), "--no-progress"]) == 0
    assert cli(["data", "pack", "--input", str(root / "raw"), "--output", str(root / "packed"),
                "--recipe", "tiny_diffusion", "--workers", "1"]) == 0
    return {"root": root, "raw": root / "raw", "packed": root / "packed", "jsonl": jsonl}


def test_packed_clips_hold_the_codecs_latents_and_text_states(clips):
    from omniweave.config import load_recipe, recipe_path, to_dict
    from omniweave.data.sources.clips_convert import ClipRawDataset
    from omniweave.diffusion.data import ClipEncoder, DiffusionSettings, clip_plan, codecs_of, decode_clip

    cfg = to_dict(load_recipe(recipe_path("tiny_diffusion"), []))
    settings = DiffusionSettings.from_mapping(cfg["data"]["diffusion"])
    encoder = ClipEncoder(codecs_of(cfg["model"]), settings, "cpu")
    ds, raw = PackedDataset(clips["packed"]), ClipRawDataset(clips["raw"])
    stats = json.loads((clips["packed"] / "stats.json").read_text())
    assert stats["samples_packed"] == 10 and stats["dropped"] == {"too_short": 1}
    seen = 0
    for i in range(len(ds)):
        pack = ds[i]
        for doc, arrays in zip(pack["docs"], pack["doc_arrays"]):
            clip = raw[doc["index"]]
            ref = encoder.encode(decode_clip(clip.data, clip.meta, clip_plan(clip.meta, settings)), clip.meta["caption"])
            assert arrays["latents"].shape == (30, 64) and list(arrays["grid"]) == [5, 2, 3]
            for key in ("latents", "text", "empty_text"):
                np.testing.assert_allclose(arrays[key], ref[key], rtol=0, atol=1e-6)
            assert doc["length"] == 30
            seen += 1
    assert seen == 10
    mb = __import__("omniweave.data.loading.loader", fromlist=["collate_pack"]).collate_pack(ds[0], cfg["data"])
    assert mb["latents"].shape[0] == int(mb["grid"].prod(1).sum()) == mb["input_ids"].numel()
    assert mb["text_cu_seqlens"][-1] == mb["text"].shape[0] and len(mb["clip_samples"]) == len(mb["grid"])


def test_the_wrong_kind_of_raw_data_or_codecs_is_refused(clips, tmp_path, capsys):
    """Clips packed with a conversation recipe, conversations with a diffusion recipe, and packs
    trained by a recipe whose VAE differs: one line each (exit 2 / UserError)."""
    def refused(argv: list[str], *words: str) -> None:
        capsys.readouterr()
        assert cli(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and all(w in err for w in words), err

    refused(["data", "pack", "--input", str(clips["raw"]), "--output", str(tmp_path / "p"), "--recipe", "demo"],
            "clips")
    assert cli(["data", "demo", str(tmp_path / "demo"), "--samples", "4", "--eval-samples", "1"]) == 0
    assert cli(["data", "convert", "--input", str(tmp_path / "demo" / "train.jsonl"), "--media-dir",
                str(tmp_path / "demo" / "media"), "--output", str(tmp_path / "conv"), "--workers", "1"]) == 0
    refused(["data", "pack", "--input", str(tmp_path / "conv"), "--output", str(tmp_path / "p2"),
             "--recipe", "tiny_diffusion"], "diffusion")
    refused(["train", "tiny_diffusion", f"data.path={clips['packed']}", f"output_dir={tmp_path / 'run'}",
             "train.steps=1", "model.vae.base_dim=12"], "data.diffusion.codecs.vae.base_dim")


def _run(clips, out, resume=None, **kw):
    train_in_process(clips["packed"], out, resume=resume, name="tiny_diffusion", data__max_len=256, **kw)
    return [(m["loss"], m["grad_norm"], m["flow_loss"]) for m in read_metrics(out)]


def test_flow_loss_falls_and_a_resumed_run_equals_an_uninterrupted_one(clips, tmp_path):
    """12 steps: the loss falls (last 3 mean below the first 3); a run resumed from its step-6
    checkpoint logs the same losses and grad norms bit for bit (each clip's draw is seeded by
    (seed, step, clip), the loader position comes back)."""
    whole = _run(clips, tmp_path / "whole", steps=12, train__save_interval=6, train__keep_last=0, train__lr=3e-3)
    assert all(np.isfinite(x) for row in whole for x in row)
    assert np.mean([r[0] for r in whole[-3:]]) < np.mean([r[0] for r in whole[:3]])
    assert all(r[0] == r[2] for r in whole)
    step6 = "checkpoints/step_000006"
    shutil.copytree(tmp_path / "whole" / step6, tmp_path / "cut" / step6)
    assert _run(clips, tmp_path / "cut", resume="auto", steps=12, train__save_interval=6, train__lr=3e-3) == whole[6:]


@pytest.mark.parametrize("layout", ["dp2", "cp2_ring", "cp2_ulysses", "tp2", "cp2_tp2"])
def test_parallel_layouts_equal_one_process(clips, tmp_path, layout):
    """dp 2 (FSDP2, gloo), sequence parallel 2 over the video tokens (ring and Ulysses attention,
    parallel/context/sequence.py), tensor parallel 2 (model.generator.tp, parallel/tp.py) and both
    (4 ranks) vs one process on the same global batch: losses, grad norms and captions dropped
    within 1e-5 relative for 3 steps; the layouts a generator does not run under yet are refused
    in one line."""
    extra = {"dp2": {}, "cp2_ring": {"parallel__cp": 2}, "cp2_ulysses": {"parallel__cp": 2,
                                                                           "parallel__cp_attention": "ulysses"},
             "tp2": {"model__generator__tp": 2}, "cp2_tp2": {"parallel__cp": 2, "model__generator__tp": 2}}
    runs = {}
    for name, n, kw in (("one", 1, {}), (layout, 4 if layout == "cp2_tp2" else 2, extra[layout])):
        out = tmp_path / name / "run"
        res = train_subprocess(clips["packed"], out, nproc=n, steps=3, global_batch=2, recipe="tiny_diffusion",
                               data__max_len=256, **kw)
        assert res.returncode == 0, res.stdout[-4000:]
        runs[name] = read_metrics(out)
    for key in ("loss", "grad_norm", "captions_dropped"):
        assert [r[key] for r in runs[layout]] == pytest.approx([r[key] for r in runs["one"]], rel=1e-5), key
    assert runs["one"][0]["mfu"] > 0
    if layout == "dp2":
        for refused in ("parallel.pp=2", "parallel.cp_attention=allgather", "parallel.seq_chunks=2"):
            assert cli(["train", "tiny_diffusion", f"data.path={clips['packed']}", f"output_dir={tmp_path / 'x'}",
                        "parallel.cp=2", refused]) == 2


def test_generate_video_samples_each_prompt_on_its_own_and_writes_clips(clips, tmp_path):
    """``omniweave generate video`` on a trained run: clip i depends only on its prompt and seed + i
    (the same clip alone or packed beside another: latents within 1e-5), guidance 1 is the text branch alone, UniPC (the default:
    tests/test_diffusion_unipc.py) and Euler (tests/test_diffusion_schedule.py) give different,
    finite latents, and the CLI writes MP4 / GIF files and generate.json (with the sampler); a size
    the VAE cannot take is one line."""
    from omniweave.diffusion.generate import VideoGenerator

    _run(clips, tmp_path / "run", steps=2)
    gen = VideoGenerator(tmp_path / "run")
    a, b = gen.sample(["a red disc moving left", "a blue disc moving up"], 5, 32, 48, steps=3, guidance=4.0, seed=7)
    assert a.shape == (5, 32, 48, 3) and a.dtype == np.uint8
    (b_alone,) = gen.sample(["a blue disc moving up"], 5, 32, 48, steps=3, guidance=4.0, seed=8)
    assert np.abs(b.astype(int) - b_alone).max() <= 1  # packed beside a, or alone: the same clip (uint8 rounding)
    pair = gen.sample_latents(["a red disc moving left", "a blue disc moving up"], 5, 32, 48, steps=3, guidance=4.0,
                              seed=7)
    one_by_one = gen.sample_latents(["a red disc moving left", "a blue disc moving up"], 5, 32, 48, steps=3,
                                    guidance=4.0, seed=7, batch=1)
    assert all((x - y).abs().max() <= 1e-5 for x, y in zip(pair, one_by_one))
    (plain,) = gen.sample(["a red disc moving left"], 5, 32, 48, steps=3, guidance=1.0, seed=7)
    assert not np.array_equal(plain, a)
    latents = {s: gen.sample_latents(["a red disc moving left"], 5, 32, 48, steps=3, guidance=4.0, seed=7, sampler=s)[0]
               for s in ("unipc", "euler")}
    assert all(torch.isfinite(z).all() for z in latents.values())
    # 4e-4 apart: a 2-step run's velocity barely depends on x or the time, so the two solvers nearly agree
    assert (latents["unipc"] - latents["euler"]).abs().max() > 1e-5
    out = tmp_path / "gen"
    assert cli(["generate", "video", str(tmp_path / "run"), "--prompt", "a red disc moving left", "--frames", "5",
                "--sampler", "unipc", "--steps", "2", "--gif", "--output", str(out)]) == 0
    record = json.loads((out / "generate.json").read_text())
    assert record["files"] == ["000.mp4"] and (out / "000.gif").is_file() and record["shift"] == 3.0
    assert record["sampler"] == "unipc" and record["device"] == "cpu" and record["fps"] == 16  # auto here: no GPU
    assert cli(["generate", "video", str(tmp_path / "run"), "--prompt", "a red disc moving left", "--frames", "5",
                "--sampler", "euler", "--steps", "2", "--output", str(tmp_path / "gen_euler")]) == 0
    assert json.loads((tmp_path / "gen_euler" / "generate.json").read_text())["sampler"] == "euler"
    assert cli(["generate", "video", str(tmp_path / "run"), "--prompt", "x", "--frames", "6", "--output", str(out)]) == 2


def test_a_run_starts_from_a_diffusers_transformer_and_exports_one(clips, tmp_path):
    """train.save_hf writes the generator as a diffusers WanTransformer3DModel folder that diffusers
    loads with our weights; train.init_from that folder starts a run from exactly those weights (a
    dp 2 run too: each rank keeps its shards); a folder of other sizes is refused naming the field."""
    from diffusers import WanTransformer3DModel

    from omniweave.models.hf.wan import load_wan_dit
    from tests.train_factory import final_state

    _run(clips, tmp_path / "a", steps=2, train__save_hf=True)
    hf = tmp_path / "a" / "hf"
    assert (hf / "config.json").is_file() and WanTransformer3DModel.from_pretrained(str(hf)) is not None
    exported = load_wan_dit(hf).state_dict()
    trained = final_state(tmp_path / "a")
    assert all(torch.equal(exported[k], trained[f"generator.{k}"]) for k in exported)
    # a run from it: its step-0 weights are the export's (save at step 1 with lr 0)
    _run(clips, tmp_path / "b", steps=1, train__init_from=str(hf), train__lr=0.0, train__save_interval=1)
    started = final_state(tmp_path / "b")
    assert all(torch.equal(exported[k], started[f"generator.{k}"]) for k in exported)
    res = train_subprocess(clips["packed"], tmp_path / "c", nproc=2, steps=1, global_batch=2, recipe="tiny_diffusion",
                           data__max_len=256, train__init_from=str(hf), train__lr=0.0, train__save_interval=1)
    assert res.returncode == 0, res.stdout[-3000:]
    assert all(torch.equal(exported[k], v) for k, v in
               ((k[len("generator."):], v) for k, v in final_state(tmp_path / "c").items()))
    assert cli(["train", "tiny_diffusion", f"data.path={clips['packed']}", f"output_dir={tmp_path / 'd'}",
                "data.max_len=256", f"train.init_from={hf}", "model.generator.num_layers=3"]) == 2
