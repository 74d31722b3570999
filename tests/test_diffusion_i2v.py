"""Wan 2.1 image-to-video (I2V), the data, training and sampling side, on synthetic clips
(diffusion/demo_data.py) with the tiny_diffusion_i2v recipe (tiny DiT with 36 input channels and image
cross-attention, the random tiny VAE / umT5 / CLIP codecs).

Checked: the conditioning (diffusion/data.py ``i2v_condition``) equals diffusers'
``WanImageToVideoPipeline.prepare_latents`` on the same VAE and frame, mask and channel order included;
a token's [noisy | cond] concatenation equals the patch of the channel-concatenated latent; ``data
pack`` with the I2V recipe stores ``cond`` / ``image`` equal to the codecs applied directly (1e-6), its
T2V arrays equal the T2V recipe's pack bit for bit, and the T2V pack has none of the I2V arrays or
codecs (its fingerprint is what it was); a run whose image conditioner (or kind) differs from the
packs' is refused in one line; the objective's 36-channel input equals the channel-concat reference
and a dropped caption keeps the image; the loss falls, a resumed run equals an uninterrupted one bit
for bit, sequence parallelism (cp 2) and tensor parallelism (tp 2) equal one process (measured: losses
and grad norms within 1.2e-7 relative); ``generate video --image`` conditions as the pack does, writes
clips and refuses the mismatches in one line."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omniweave.cli import main as cli
from omniweave.data.packing.packed import PackedDataset
from tests.train_factory import read_metrics, train_in_process, train_subprocess

I2V, T2V = "tiny_diffusion_i2v", "tiny_diffusion"


def _recipe(name: str) -> dict:
    from omniweave.config import load_recipe, recipe_path, to_dict

    return to_dict(load_recipe(recipe_path(name), []))


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict:
    from omniweave.diffusion.demo_data import render_clip, write_clips_dataset, write_mp4

    root = tmp_path_factory.mktemp("i2v")
    jsonl = write_clips_dataset(root / "clips", num_clips=6, progress=False)
    write_mp4(root / "clips" / "videos" / "short.mp4", render_clip(3, frames=5)[:3], fps=16)  # 3 frames < 17
    with open(jsonl, "a") as f:
        f.write(json.dumps({"id": "short", "video": "videos/short.mp4", "caption": "a red disc moving left"}) + "\n")
    assert cli(["data", "convert", "--format", "clips", "--input", str(jsonl), "--media-dir", str(root / "clips"),
                "--output", str(root / "raw"), "--no-progress"]) == 0
    for name, out in ((I2V, "packed"), (T2V, "packed_t2v")):
        assert cli(["data", "pack", "--input", str(root / "raw"), "--output", str(root / out), "--recipe", name,
                    "--workers", "1"]) == 0
    return {"root": root, "raw": root / "raw", "packed": root / "packed", "t2v": root / "packed_t2v"}


def _run(clips, out, resume=None, **kw):
    train_in_process(clips["packed"], out, resume=resume, name=I2V, data__max_len=256, **kw)
    return [(m["loss"], m["grad_norm"], m["flow_loss"]) for m in read_metrics(out)]


# ---------------------------------------------------------------------------------- pure checks


def test_token_concat_is_the_patch_of_the_channel_concat():
    """patchify lays a token out channel-major, so [noisy tokens | cond tokens] per token is the patch
    of the [noisy | mask | cond] channel-concatenated latent (what diffusers feeds the DiT)."""
    from omniweave.diffusion.objective import i2v_input
    from omniweave.models.components.wan_dit import patchify

    g = torch.Generator().manual_seed(0)
    for patch in ((1, 2, 2), (2, 1, 3)):
        noisy, cond = torch.randn(16, 4, 6, 12, generator=g), torch.randn(20, 4, 6, 12, generator=g)
        ref = patchify(torch.cat([noisy, cond]), patch)
        assert torch.equal(i2v_input(patchify(noisy, patch), patchify(cond, patch)), ref)


def test_conditioning_equals_diffusers_prepare_latents(tmp_path):
    """``i2v_condition``'s cond (mask 4, then the normalised VAE latent of [frame, zero frames]) is
    ``WanImageToVideoPipeline.prepare_latents``' condition on the same VAE (saved as a diffusers
    folder) and frame, patchified; its mask is 1 on latent frame 0's 4 channels, 0 elsewhere; the
    image features are the conditioner's ``clip_features`` of the frame."""
    diffusers = pytest.importorskip("diffusers")
    from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline

    from omniweave.diffusion.data import first_frame_mask, i2v_condition
    from omniweave.diffusion.image_encoder import WanImageEncoder
    from omniweave.models.components.wan_dit import patchify, unpatchify
    from omniweave.models.registry import build_component

    vae = build_component("vae", _recipe(I2V)["model"]["vae"]).eval()
    ref_vae = diffusers.AutoencoderKLWan.from_pretrained(str(vae.save_diffusers_dir(tmp_path / "vae"))).eval()
    clip = WanImageEncoder.tiny()
    frame = (np.random.default_rng(0).random((32, 48, 3)) * 255).astype(np.uint8)
    frames, patch = 9, (1, 2, 2)
    cond, image = i2v_condition(vae, clip, frame, frames, patch)
    pipe = SimpleNamespace(vae=ref_vae, config=SimpleNamespace(expand_timesteps=False), vae_scale_factor_temporal=4,
                           vae_scale_factor_spatial=8)
    pixels = torch.from_numpy(frame).permute(2, 0, 1)[None].float() / 127.5 - 1.0
    with torch.no_grad():
        _, ref = WanImageToVideoPipeline.prepare_latents(pipe, pixels, 1, 16, 32, 48, frames, torch.float32,
                                                         torch.device("cpu"), None, torch.zeros(1, 16, 3, 4, 6))
    assert ref.shape == (1, 20, 3, 4, 6)
    assert (cond - patchify(ref[0], patch)).abs().max() < 1e-5
    mask = unpatchify(cond, (3, 2, 3), 20, patch)[:4]
    assert torch.equal(mask, first_frame_mask(frames, 3, 4, 6))
    assert bool((mask[:, 0] == 1).all()) and bool((mask[:, 1:] == 0).all())
    assert torch.equal(image, clip.clip_features(frame).float()) and image.shape == (26, 32)


# ---------------------------------------------------------------------------------- packing


def test_packed_i2v_clips_hold_the_codecs_conditioning(clips):
    """Each packed clip's cond / image equal ``i2v_condition`` with the recipe's codecs on the same
    decoded frames (1e-6); its latents / text / grid equal the T2V recipe's pack bit for bit, whose
    clips hold no I2V arrays and whose codecs have no image_conditioner; the short clip is a counted
    drop in both; the loader's row gives cond / image / image_cu_seqlens."""
    from omniweave.data.loading.loader import collate_pack
    from omniweave.data.sources.clips_convert import ClipRawDataset
    from omniweave.diffusion.data import ClipEncoder, DiffusionSettings, clip_plan, codecs_of, decode_clip

    cfg = _recipe(I2V)
    settings = DiffusionSettings.from_mapping(cfg["data"]["diffusion"])
    encoder = ClipEncoder(codecs_of(cfg["model"]), settings, "cpu")
    ds, t2v, raw = PackedDataset(clips["packed"]), PackedDataset(clips["t2v"]), ClipRawDataset(clips["raw"])
    for path in (clips["packed"], clips["t2v"]):
        stats = json.loads((path / "stats.json").read_text())
        assert stats["samples_packed"] == 6 and stats["dropped"] == {"too_short": 1}
    manifests = [json.loads((p / "manifest.json").read_text()) for p in (clips["packed"], clips["t2v"])]
    codecs = [json.dumps(m).count('"image_conditioner"') for m in manifests]
    assert codecs[0] > 0 and codecs[1] == 0
    assert len(ds) == len(t2v)
    seen = 0
    for i in range(len(ds)):
        pack, plain = ds[i], t2v[i]
        for doc, arrays, plain_arrays in zip(pack["docs"], pack["doc_arrays"], plain["doc_arrays"]):
            assert set(plain_arrays) == {"latents", "grid", "text", "empty_text"}
            assert set(arrays) == set(plain_arrays) | {"cond", "image"}
            for key in plain_arrays:
                assert np.array_equal(arrays[key], plain_arrays[key]), key
            clip = raw[doc["index"]]
            ref = encoder.encode(decode_clip(clip.data, clip.meta, clip_plan(clip.meta, settings)), clip.meta["caption"])
            assert arrays["cond"].shape == (30, 80) and arrays["image"].shape == (26, 32)
            for key in ("cond", "image"):
                np.testing.assert_allclose(arrays[key], ref[key], rtol=0, atol=1e-6)
            seen += 1
    assert seen == 6
    mb = collate_pack(ds[0], cfg["data"])
    m = len(mb["grid"])
    assert mb["cond"].shape == (mb["latents"].shape[0], 80) and mb["image"].shape == (26 * m, 32)
    assert mb["image_cu_seqlens"].tolist() == [26 * k for k in range(m + 1)]
    assert "cond" not in collate_pack(t2v[0], _recipe(T2V)["data"])


def test_inspect_names_the_image_conditioning(clips, capsys):
    assert cli(["data", "inspect", str(clips["packed"])]) == 0
    assert "image-to-video: image conditioner clip_vision; first-frame features (tokens x width) 26 x 32: 6" in \
        capsys.readouterr().out
    assert cli(["data", "inspect", str(clips["t2v"])]) == 0
    assert "image-to-video" not in capsys.readouterr().out


def test_packs_of_other_codecs_or_kind_are_refused(clips, tmp_path):
    """One line (exit 2) each: T2V recipe on I2V packs, I2V recipe on T2V packs, another image
    conditioner; an I2V generator without a conditioner or with the wrong input channels."""
    base = ["train", I2V, f"output_dir={tmp_path / 'run'}", "train.steps=1"]
    assert cli(["train", T2V, f"data.path={clips['packed']}", f"output_dir={tmp_path / 'run'}", "train.steps=1"]) == 2
    assert cli([*base, f"data.path={clips['t2v']}"]) == 2
    assert cli([*base, f"data.path={clips['packed']}", "model.image_conditioner.seed=1"]) == 2
    assert cli([*base, f"data.path={clips['packed']}", "model.generator.in_channels=16"]) == 2
    assert cli(["data", "pack", "--input", str(clips["raw"]), "--output", str(tmp_path / "p"), "--recipe", T2V,
                "model.generator.image_dim=32", "model.generator.added_kv_proj_dim=48"]) == 2


# ---------------------------------------------------------------------------------- objective


def test_the_objective_feeds_the_channel_concat_and_keeps_the_image(clips):
    """The row's model input = per clip, patchify(cat([noisy 16, cond 20])) of the unpatchified parts;
    its first 16·p columns and the target are the T2V objective's (the same draws); the image and its
    segments go through unchanged, also when every caption is dropped."""
    from omniweave.data.loading.loader import collate_pack
    from omniweave.diffusion.objective import DiffusionObjective
    from omniweave.models.components.wan_dit import patchify, unpatchify_clips
    from omniweave.models.registry import build_model

    cfg = _recipe(I2V)
    model = build_model(cfg["model"])
    mb = collate_pack(PackedDataset(clips["packed"])[0], cfg["data"])
    plain = {k: v for k, v in mb.items() if k not in ("cond", "image", "image_cu_seqlens")}
    obj = DiffusionObjective(seed=3, step=lambda: 2, caption_dropout=0.0)
    row, t2v_row = obj.row_inputs(model, mb), obj.row_inputs(None, plain)
    assert row["noisy"].shape == (mb["latents"].shape[0], 36 * 4)
    assert torch.equal(row["noisy"][:, :64], t2v_row["noisy"]) and torch.equal(row["target"], t2v_row["target"])
    noisy = unpatchify_clips(t2v_row["noisy"], mb["grid"], 16, (1, 2, 2))
    cond = unpatchify_clips(mb["cond"], mb["grid"], 20, (1, 2, 2))
    ref = torch.cat([patchify(torch.cat([a, b]), (1, 2, 2)) for a, b in zip(noisy, cond)])
    assert torch.equal(row["noisy"], ref)
    assert row["image"] is mb["image"] and row["image_cu_seqlens"] is mb["image_cu_seqlens"]
    assert model(row).shape == (mb["latents"].shape[0], 64)  # the DiT takes it: 16-channel velocity
    dropped = DiffusionObjective(seed=3, step=lambda: 2, caption_dropout=1.0).row_inputs(model, mb)
    assert float(dropped["captions_dropped"]) == len(mb["grid"]) and dropped["image"] is mb["image"]
    with pytest.raises(ValueError, match="image-to-video generator"):
        obj.row_inputs(model, plain)


# ---------------------------------------------------------------------------------- training


def test_i2v_loss_falls_and_a_resumed_run_equals_an_uninterrupted_one(clips, tmp_path):
    """12 steps: the loss falls (last 3 mean below the first 3); resumed from step 6 = uninterrupted,
    losses and grad norms bit for bit."""
    whole = _run(clips, tmp_path / "whole", steps=12, train__save_interval=6, train__keep_last=0, train__lr=3e-3)
    assert all(np.isfinite(x) for row in whole for x in row)
    assert np.mean([r[0] for r in whole[-3:]]) < np.mean([r[0] for r in whole[:3]])
    step6 = "checkpoints/step_000006"
    shutil.copytree(tmp_path / "whole" / step6, tmp_path / "cut" / step6)
    assert _run(clips, tmp_path / "cut", resume="auto", steps=12, train__save_interval=6, train__lr=3e-3) == whole[6:]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["cp2", "tp2"])
def test_i2v_parallel_layouts_equal_one_process(clips, tmp_path, layout):
    """cp 2 (ring) over the video tokens, the image features replicated like the text; tp 2
    (model.generator.tp: the heads, the cross-attention's added image keys / values with them): losses,
    grad norms and captions dropped within 1e-5 relative of one process for 3 steps."""
    extra = {"cp2": {"parallel__cp": 2}, "tp2": {"model__generator__tp": 2}}
    runs = {}
    for name, n, kw in (("one", 1, {}), (layout, 2, extra[layout])):
        out = tmp_path / name / "run"
        res = train_subprocess(clips["packed"], out, nproc=n, steps=3, global_batch=2, recipe=I2V, data__max_len=256,
                               **kw)
        assert res.returncode == 0, res.stdout[-4000:]
        runs[name] = read_metrics(out)
    for key in ("loss", "grad_norm", "captions_dropped"):
        got, want = [r[key] for r in runs[layout]], [r[key] for r in runs["one"]]
        print(f"I2V {layout} {key}: max rel {max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want)):.2e}")
        assert got == pytest.approx(want, rel=1e-5), key


# ---------------------------------------------------------------------------------- sampling


def test_generate_video_with_an_image(clips, tmp_path):
    """``VideoGenerator`` conditions a clip on its image exactly as the pack did (the same cond and
    features for a packed clip's first frame); a clip is the same alone or packed beside another
(within 1e-5), one image
    for all prompts = that image given per prompt, another image changes the clip; the CLI writes
    MP4s and generate.json (with the images); an I2V run without --image, a count that matches
    neither 1 nor the prompts, an unreadable image, and --image to a T2V run: one line each."""
    from PIL import Image

    from omniweave.data.sources.clips_convert import ClipRawDataset
    from omniweave.diffusion.data import DiffusionSettings, clip_plan, decode_clip
    from omniweave.diffusion.generate import VideoGenerator

    _run(clips, tmp_path / "run", steps=2)
    gen = VideoGenerator(tmp_path / "run")
    ds, raw = PackedDataset(clips["packed"]), ClipRawDataset(clips["raw"])
    doc, arrays = ds[0]["docs"][0], ds[0]["doc_arrays"][0]
    clip = raw[doc["index"]]
    frames = decode_clip(clip.data, clip.meta, clip_plan(clip.meta, DiffusionSettings.from_mapping(
        _recipe(I2V)["data"]["diffusion"])))
    cond, image = gen._condition(frames[0], len(frames), (1, 2, 2))
    np.testing.assert_allclose(cond.numpy(), arrays["cond"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(image["image"].numpy(), arrays["image"], rtol=0, atol=1e-6)

    first, other = frames[0], frames[0][:, ::-1].copy()
    kw = dict(frames=5, height=32, width=48, steps=2, guidance=4.0)
    a, b = gen.sample_latents(["a red disc moving left", "a blue disc moving up"], seed=7, images=[first], **kw)
    (b_alone,) = gen.sample_latents(["a blue disc moving up"], seed=8, images=[first], **kw)
    assert (b - b_alone).abs().max() <= 1e-5 and torch.isfinite(a).all()  # packed beside a, or alone
    a2, _ = gen.sample_latents(["a red disc moving left", "a blue disc moving up"], seed=7, images=[first, first], **kw)
    assert torch.equal(a, a2)
    (c,) = gen.sample_latents(["a red disc moving left"], seed=7, images=[other], **kw)
    assert not torch.equal(a, c)

    png = tmp_path / "first.png"
    Image.fromarray(first).save(png)
    out = tmp_path / "gen"
    args = ["generate", "video", str(tmp_path / "run"), "--prompt", "a red disc moving left", "--frames", "5",
            "--steps", "2", "--output", str(out)]
    assert cli([*args, "--image", str(png), "--gif"]) == 0
    record = json.loads((out / "generate.json").read_text())
    assert record["files"] == ["000.mp4"] and record["images"] == [str(png)] and (out / "000.gif").is_file()
    assert cli(args) == 2
    assert cli([*args, "--prompt", "x", "--prompt", "y", "--image", str(png), "--image", str(png)]) == 2
    assert cli([*args, "--image", str(tmp_path / "missing.png")]) == 2
    train_in_process(clips["t2v"], tmp_path / "t2v", name=T2V, data__max_len=256, steps=1)
    assert cli(["generate", "video", str(tmp_path / "t2v"), "--prompt", "x", "--frames", "5", "--steps", "1",
                "--output", str(tmp_path / "g2"), "--image", str(png)]) == 2
