"""train.phase=vla end to end on the synthetic reaching task (vla/demo_data.py): a LeRobot
dataset -> ``data convert --format lerobot`` -> ``data pack --recipe demo_vla`` -> ``omniweave train``.

Checked: every packed frame holds its observation prompt (all of it the bidirectional prefix), its
camera frame as the image and its action chunk normalised exactly as lerobot_stats.json says; the
loader's micro-batch carries the VLA keys; packing refuses the wrong kind of raw data in one line;
the flow loss falls; with data.vla.action_bins each frame's labelled tail is its digitised chunk and
train.vla.text_weight adds that text's weighted cross-entropy; a resumed run equals an uninterrupted
one bit for bit; two data-parallel ranks, foundation tp 2 and cp 2 equal one process (losses and
grad norms within 1e-5 relative)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from omniweave.cli import main as cli
from omniweave.data.packing.packed import PackedDataset
from omniweave.data.sources.lerobot import normalize
from omniweave.errors import UserError
from tests.train_factory import final_state, read_metrics, train_in_process, train_subprocess

H = 4


@pytest.fixture(scope="module")
def vla_data(tmp_path_factory) -> dict:
    from omniweave.vla.demo_data import write_reach_dataset

    root = tmp_path_factory.mktemp("vla")
    write_reach_dataset(root / "ds", episodes=24, seed=0)
    assert cli(["data", "convert", "--format", "lerobot", "--input", str(root / "ds"), "--output", str(root / "raw"),
                "--horizon", str(H), "--no-progress"]) == 0
    assert cli(["data", "pack", "--input", str(root / "raw"), "--output", str(root / "packed"), "--recipe", "demo_vla",
                "--max-len", "512", "--workers", "1"]) == 0
    return {"root": root, "raw": root / "raw", "packed": root / "packed"}


def test_packed_frames_hold_prompts_images_and_normalised_chunks(vla_data):
    """Each document: one image (the camera frame), labels all -100, prefix_len = its length; its
    action chunk = the raw chunk normalised with the converted statistics (float32 exact), its
    padding flags the converter's; the loader's micro-batch carries prefix_lens / action keys."""
    from omniweave.data.loading.loader import collate_pack
    from omniweave.data.sources.shards import RawDataset, parse_sample_bytes

    from omniweave.config import load_recipe, to_dict

    stats = json.loads((vla_data["raw"] / "lerobot_stats.json").read_text())
    action_stats = {k: np.asarray(v, np.float64) for k, v in stats["action"].items()}
    raw = RawDataset(vla_data["raw"])
    ds = PackedDataset(vla_data["packed"])
    data_cfg = to_dict(load_recipe("demo_vla").data)
    frames = 0
    for i in range(len(ds)):
        pack = ds[i]
        cu = pack["cu_seqlens"]
        for d, doc in enumerate(pack["docs"]):
            frame = json.loads(parse_sample_bytes(raw.read_bytes(doc["index"]))[1]["vla.json"])
            want = normalize(np.asarray(frame["actions"], np.float64), action_stats).astype(np.float32)
            assert np.array_equal(pack["doc_arrays"][d]["actions"], want)
            assert doc["vla"]["is_pad"] == frame["action_is_pad"]
            assert doc["vla"]["prefix_len"] == cu[d + 1] - cu[d]
            assert sum(m["doc"] == d for m in pack["media"]) == 1
            frames += 1
        assert (pack["labels"] == -100).all()
        mb = collate_pack(pack, data_cfg)
        n = len(pack["docs"])
        assert mb["prefix_lens"].tolist() == np.diff(cu).tolist()
        assert mb["actions"].shape == (n, H, 2) and mb["action_is_pad"].shape == (n, H)
        assert mb["action_docs"].tolist() == list(range(n))
        assert mb["num_action_values"] == int((~mb["action_is_pad"]).sum()) * 2
        assert mb["pixel_values"].shape[0] > 0 and mb["grid_thw"].shape[0] == n
    assert frames == len(raw)


def test_two_camera_frames_pack_both_images_in_camera_order_or_the_cameras_asked_for(tmp_path):
    """tests/lerobot_factory.py's two-camera dataset (top: grey frames; wrist: the same levels in red
    here, so the two can be told apart; the cameras' videos hold different episodes per file) through
    convert and pack with demo_vla: each document holds two images, top then wrist, each the frame of
    the document's own global index (level colour(g) within 3 after H.264); the loader's micro-batch
    has two image grids per document. data.vla.cameras=[wrist] packs the wrist camera alone."""
    import io

    from PIL import Image

    from omniweave.config import load_recipe, to_dict
    from omniweave.data.loading.loader import collate_pack
    from omniweave.data.sources.lerobot_write import plan_dataset, write_tables
    from tests import lerobot_factory as F

    top, wrist = F.CAMERAS  # the factory's (and the conversion's) camera order
    episodes = F.episodes()
    for ep in episodes:
        ep["images"][wrist] = ep["images"][wrist] * np.array([1, 0, 0], np.uint8)
    write_tables(tmp_path / "ds", plan_dataset(episodes, fps=F.FPS, files=F.DATA_FILES, video_files=F.CAMERAS))
    assert cli(["data", "convert", "--format", "lerobot", "--input", str(tmp_path / "ds"), "--output",
                str(tmp_path / "raw"), "--horizon", str(H), "--no-progress"]) == 0

    def mean_rgb(item: dict) -> np.ndarray:
        return np.asarray(Image.open(io.BytesIO(item["bytes"])).convert("RGB"), np.float64).reshape(-1, 3).mean(0)

    def looks_like(rgb: np.ndarray, camera: str, g: int) -> bool:
        want = [F.colour(g)] * 3 if camera == top else [F.colour(g), 0, 0]
        return bool(np.abs(rgb - want).max() <= 3)

    for name, extra, cameras in (("both", [], [top, wrist]), ("wrist", [f"data.vla.cameras=[{wrist}]"], [wrist])):
        packed = tmp_path / name
        assert cli(["data", "pack", "--input", str(tmp_path / "raw"), "--output", str(packed), "--recipe", "demo_vla",
                    "--max-len", "512", "--workers", "1", *extra]) == 0
        ds, docs = PackedDataset(packed), 0
        data_cfg = to_dict(load_recipe("demo_vla", extra).data)
        for i in range(len(ds)):
            pack = ds[i]
            for d, doc in enumerate(pack["docs"]):
                items = sorted((m for m in pack["media"] if m["doc"] == d), key=lambda m: m["start"])
                assert [m["part"] for m in items] == cameras
                g = doc["vla"]["frame"]
                assert all(looks_like(mean_rgb(m), m["part"], g) for m in items), (name, g)
                docs += 1
            assert collate_pack(pack, data_cfg)["grid_thw"].shape[0] == len(cameras) * len(pack["docs"])
        assert docs == sum(F.LENGTHS)


def test_pack_refuses_the_other_kind_of_raw_data(vla_data, tmp_path):
    """Robot frames packed with a conversation recipe, or conversations with a VLA recipe: one line."""
    with pytest.raises(UserError, match="robot frames"):
        from omniweave.data.packing.pack import add_arguments, run  # noqa: F401
        import argparse

        p = argparse.ArgumentParser()
        add_arguments(p)
        run(p.parse_args(["--input", str(vla_data["raw"]), "--output", str(tmp_path / "p"), "--recipe", "demo"]))
    assert cli(["data", "demo", str(tmp_path / "demo"), "--samples", "8", "--eval-samples", "2"]) == 0
    assert cli(["data", "convert", "--input", str(tmp_path / "demo" / "train.jsonl"), "--media-dir",
                str(tmp_path / "demo" / "media"), "--output", str(tmp_path / "conv"), "--workers", "1"]) == 0
    assert cli(["data", "pack", "--input", str(tmp_path / "conv"), "--output", str(tmp_path / "p2"),
                "--recipe", "demo_vla"]) == 2


def _run(vla_data, out, resume=None, **kw):
    train_in_process(vla_data["packed"], out, resume=resume, name="demo_vla", data__max_len=512, **kw)
    return [(m["loss"], m["grad_norm"], m["flow_loss"]) for m in read_metrics(out)]


def test_flow_loss_falls_and_a_resumed_run_equals_an_uninterrupted_one(vla_data, tmp_path):
    """8 steps at lr 3e-3: the flow loss falls (last 3 mean below the first 3); a run resumed
    from its step-4 checkpoint logs the same losses and grad norms bit for bit (the flow draw is
    seeded by (seed, step, frame), the loader position comes back)."""
    whole = _run(vla_data, tmp_path / "whole", steps=8, train__save_interval=4, train__lr=3e-3, train__keep_last=0)
    assert all(np.isfinite(x) for row in whole for x in row)
    assert np.mean([r[0] for r in whole[-3:]]) < np.mean([r[0] for r in whole[:3]])
    assert all(r[0] == r[2] for r in whole)  # the loss is the flow loss (no text co-training)
    step4 = "checkpoints/step_000004"
    shutil.copytree(tmp_path / "whole" / step4, tmp_path / "cut" / step4)
    assert _run(vla_data, tmp_path / "cut", resume="auto", steps=8, train__save_interval=4, train__lr=3e-3) == whole[4:]


def digitised(actions: np.ndarray, bins: int) -> str:
    """The co-training answer written out independently of the packer: each normalised action value's
    bin of ``bins`` equal bins over [-1, 1] (np.digitize - 1, no clipping), space-separated."""
    edges = np.linspace(-1.0, 1.0, bins + 1)[:-1]
    return " ".join(str(int(b) - 1) for b in np.digitize(actions.reshape(-1).astype(np.float64), edges))


@pytest.fixture(scope="module")
def binned(vla_data) -> Path:
    """vla_data's frames packed with data.vla.action_bins=16: each chunk also as a labelled text answer."""
    packed = vla_data["root"] / "packed_bins16"
    assert cli(["data", "pack", "--input", str(vla_data["raw"]), "--output", str(packed), "--recipe", "demo_vla",
                "--max-len", "512", "--workers", "1", "data.vla.action_bins=16"]) == 0
    return packed


def test_action_bins_label_each_frame_with_its_digitised_unpadded_chunk(vla_data, binned):
    """data.vla.action_bins=16: every document's labelled tail is its chunk's unpadded normalised
    actions digitised into 16 bins (then the chat template's end of turn), and it starts right after
    the prefix (the expert never reads it); padded steps are left out of the answer."""
    from omniweave.data.sources.shards import RawDataset
    from omniweave.data.text.tokenizer import load_tokenizer

    tok = load_tokenizer("demo")
    ds = PackedDataset(binned)
    padded = docs = 0
    for i in range(len(ds)):
        pack = ds[i]
        cu = pack["cu_seqlens"]
        for d, doc in enumerate(pack["docs"]):
            labels = pack["labels"][cu[d]:cu[d + 1]]
            tail = np.flatnonzero(labels != -100)  # positions whose next token is labelled (labels are shifted)
            assert tail[0] == doc["vla"]["prefix_len"] - 1 and np.array_equal(tail, np.arange(tail[0], tail[-1] + 1))
            real = ~np.asarray(doc["vla"]["is_pad"])
            padded += int(not real.all())
            want = digitised(pack["doc_arrays"][d]["actions"][real], 16)
            assert tok.decode(labels[tail].tolist()) == want + "<|im_end|>\n"
            docs += 1
    assert padded > 0 and docs == len(RawDataset(vla_data["raw"]))  # every frame; chunks past an episode's end too


def test_co_training_adds_the_weighted_text_loss_on_the_action_normaliser(binned, tmp_path):
    """Trained 2 steps on the action_bins packs with train.vla.text_weight=0.5, plain and with
    knowledge insulation: text_loss is logged finite and the logged loss is the objective's
    (flow SSE + 0.5 * text CE sum) / action values, i.e. flow_loss + 0.5 * text_loss * loss_tokens /
    action_values, within 1e-6. Insulation changes the step-2 gradient only: at step 1 the expert's
    gates are closed (zero-initialised), so no flow gradient reaches the backbone either way."""
    runs = {}
    for insulated in (False, True):
        out = tmp_path / f"insulated_{insulated}"
        train_in_process(binned, out, name="demo_vla", data__max_len=512, data__vla__action_bins=16, steps=2,
                         train__vla__text_weight=0.5, model__action_expert__knowledge_insulation=insulated)
        runs[insulated] = rows = read_metrics(out)
        assert len(rows) == 2
        for r in rows:
            assert np.isfinite(r["text_loss"]) and r["text_loss"] > 0 and r["loss_tokens"] > 0
            text_term = r["text_loss"] * r["loss_tokens"] / r["action_values"]  # the CE sum on the action normaliser
            assert r["loss"] == pytest.approx(r["flow_loss"] + 0.5 * text_term, abs=1e-6)
            assert r["loss"] - r["flow_loss"] > 1e-3  # the text term is really in it
    plain, insulated = runs[False], runs[True]
    assert plain[0]["grad_norm"] == insulated[0]["grad_norm"] and plain[1]["grad_norm"] != insulated[1]["grad_norm"]


def test_activation_checkpointing_changes_nothing(vla_data, tmp_path):
    """train.ac=full (every backbone, encoder and expert layer recomputed in the backward; the
    prefix keys / values the expert reads come out of checkpointed layers) logs the losses and
    grad norms of train.ac=none within 1e-6 relative."""
    plain = _run(vla_data, tmp_path / "none", steps=2)
    full = _run(vla_data, tmp_path / "full", steps=2, train__ac="full")
    assert np.allclose(np.array(full), np.array(plain), rtol=1e-6, atol=0)


@pytest.mark.parametrize("backbone", ["frozen", "lora"])
def test_the_backbone_can_be_frozen_or_adapted_while_the_expert_trains(vla_data, tmp_path, backbone):
    """model.foundation.freeze: the backbone's weights stay bit-identical from step 1 to step 2 while
    every expert weight moves; model.foundation.lora: the base weights stay, the expert moves and
    every adapter on the flow loss's path learns (its lora_B, zero at the start, moves) -- all but
    the last layer's q_proj, whose queries feed only the text head (no text loss here; the chunks
    read the backbone's keys and values): its lora_B stays zero."""
    extra = ({"model__foundation__freeze": True} if backbone == "frozen"
             else {"+model__foundation__lora": "{r: 4, alpha: 8, targets: [q_proj, v_proj]}"})
    _run(vla_data, tmp_path / "run", steps=2, train__save_interval=1, train__lr=3e-3, train__keep_last=0, **extra)
    before, after = (final_state(tmp_path / "run" / f"checkpoints/step_00000{s}") for s in (1, 2))
    moved = {k for k in after if not torch.equal(before[k], after[k])}
    foundation = {k for k in after if k.startswith("foundation.")}
    adapters = {k for k in foundation if "lora_" in k}
    assert foundation - adapters and not (foundation - adapters) & moved
    learned = {k for k in adapters if "lora_B" in k}
    off_path = {"foundation.layers.1.self_attn.q_proj.lora_B.weight"}
    assert (backbone == "lora") == bool(adapters) and all(float(after[k].abs().max()) == 0 for k in off_path & learned)
    assert learned - off_path <= moved and not off_path & moved
    expert = {k for k in after if k.startswith("action_expert.")}
    assert expert <= moved, sorted(expert - moved)[:5]


def test_data_tensor_and_context_parallel_ranks_equal_one_process(vla_data, tmp_path):
    """dp 2 (FSDP2, gloo), foundation tp 2 (the expert sharded with it) and cp 2 (zigzag rows, the
    prefix keys / values all-gathered, the chunks shared) vs one process on the same global batch:
    losses and grad norms within 1e-5 relative for 3 steps."""
    runs = {}
    for name, n, extra in (("one", 1, {}), ("dp2", 2, {}), ("tp2", 2, {"model__foundation__tp": 2}),
                           ("cp2", 2, {"parallel__cp": 2})):
        out = tmp_path / name / "run"
        res = train_subprocess(vla_data["packed"], out, nproc=n, steps=3, global_batch=4, recipe="demo_vla",
                               data__max_len=512, **extra)
        assert res.returncode == 0, res.stdout[-4000:]
        runs[name] = read_metrics(out)
    for name in ("dp2", "tp2", "cp2"):
        assert [r["loss"] for r in runs[name]] == pytest.approx([r["loss"] for r in runs["one"]], rel=1e-5), name
        assert [r["grad_norm"] for r in runs[name]] == pytest.approx([r["grad_norm"] for r in runs["one"]], rel=1e-5)


def test_layouts_the_expert_cannot_run_under_are_refused():
    """seq_chunks / pp with train.phase=vla: a LayoutError naming the key (tp and cp run). The
    expert runs on the backbone's tp ranks, so a model.action_expert.tp of its own (other than 1 or
    the foundation's, which say the same) is refused in one line naming model.foundation.tp, not
    ignored."""
    from omniweave.config import load_recipe
    from omniweave.train.layouts import LayoutError, check

    check(load_recipe("demo_vla"))
    check(load_recipe("demo_vla", ["model.foundation.tp=2", "parallel.cp=2"]))
    check(load_recipe("demo_vla", ["model.foundation.tp=2", "model.action_expert.tp=2"]))
    for key in ("parallel.seq_chunks", "parallel.pp"):
        with pytest.raises(LayoutError, match=f"train.phase=vla with {key}=2"):
            check(load_recipe("demo_vla", [f"{key}=2"]))
    for overrides in (["model.action_expert.tp=2"], ["model.foundation.tp=2", "model.action_expert.tp=4"]):
        with pytest.raises(LayoutError) as refused:
            check(load_recipe("demo_vla", overrides))
        foundation_tp = 2 if len(overrides) == 2 else 1
        assert str(refused.value) == (
            f"{overrides[-1]}: the action expert shares the backbone's tp (its queries read the backbone's local "
            f"key/value heads), model.foundation.tp={foundation_tp}; set model.foundation.tp and leave "
            "model.action_expert.tp at 1")


def test_a_trained_run_samples_chunks_for_recorded_frames_and_live_observations(vla_data, tmp_path, capsys):
    """``omniweave vla sample`` on a 2-step run: one JSONL line per frame with an [H, 2] finite chunk
    in the dataset's units and the recorded one, the MSE summary; the Policy API on a live
    observation gives the same shape, and a camera the policy needs but the observation lacks is
    one clear error. The policy's chunk is the model's normalised sample for the same noise (seed)
    unnormalised with the run's quantiles, within 1e-6."""
    from omniweave.vla.policy import Policy
    from omniweave.vla.sim import ReachSim

    _run(vla_data, tmp_path / "run", steps=2)
    out = tmp_path / "chunks.jsonl"
    assert cli(["vla", "sample", str(tmp_path / "run"), "--frames", str(vla_data["raw"]), "--count", "5",
                "--batch", "2", "--output", str(out)]) == 0
    assert "vla sample: 5 chunks of 4 actions (0 frames unreadable); MSE vs recorded" in capsys.readouterr().out
    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [ln["index"] for ln in lines] == list(range(5))
    assert all(np.isfinite(ln["chunk"]).all() and np.shape(ln["chunk"]) == (H, 2) for ln in lines)
    policy = Policy.load(tmp_path / "run")
    obs = ReachSim(3).observation()
    assert policy(obs).shape == (H, 2)
    with pytest.raises(UserError, match="lacks camera"):
        policy({**obs, "images": {}})

    # the chunk returned is the model's normalised sample, from the same noise, mapped back to the
    # dataset's units with the quantiles: (y + 1) / 2 * (q99 - q01) + q01, written out here
    got = Policy.load(tmp_path / "run", seed=7)(obs)
    twin = Policy.load(tmp_path / "run", seed=7)
    noise = torch.randn(1, H, twin.width, generator=twin.generator)
    with torch.no_grad():
        normalised = twin.model.sample_actions(twin.rows([obs]), noise).double().numpy()[0, :, :2]
    q01, q99 = (np.asarray(twin.stats["action"][k], np.float64) for k in ("q01", "q99"))
    assert (q99 - q01 > 1e-3).all() and not np.allclose(got, normalised, atol=1e-2)
    np.testing.assert_allclose(got, (normalised + 1) / 2 * (q99 - q01) + q01, rtol=0, atol=1e-6)


def test_save_hf_of_a_model_without_a_lerobot_layout_is_refused_before_training(vla_data, tmp_path):
    """train.save_hf=true on demo_vla (a Qwen2.5-shaped backbone: not one of lerobot's Pi0.5
    layouts) fails at set-up in one line, not after the last step; no step is logged."""
    with pytest.raises(UserError, match="train.save_hf=true: the final model cannot be exported: .*lerobot"):
        _run(vla_data, tmp_path / "run", steps=2, train__save_hf=True)
    assert read_metrics(tmp_path / "run") == []


def test_tiny_pi05_packs_camera_frames_padded_to_its_tower_and_trains(vla_data, tmp_path):
    """Recipe tiny_pi05 (PaliGemma-shaped backbone + Gemma expert, data.vision.tiling: pad): the
    56 px camera frames reach the 42 px SigLIP tower resized with padding (grid 1 x 3 x 3, pixels
    in [-1, 1]), and 3 training steps run with a finite, changing loss."""
    from omniweave.config import load_recipe, to_dict
    from omniweave.data.loading.loader import collate_pack

    packed = tmp_path / "packed"
    assert cli(["data", "pack", "--input", str(vla_data["raw"]), "--output", str(packed), "--recipe", "tiny_pi05",
                "--max-len", "512", "--workers", "1"]) == 0
    mb = collate_pack(PackedDataset(packed)[0], to_dict(load_recipe("tiny_pi05").data))
    assert mb["grid_thw"].tolist() == [[1, 3, 3]] * len(mb["prefix_lens"])
    assert float(mb["pixel_values"].min()) >= -1 and float(mb["pixel_values"].max()) <= 1
    train_in_process(packed, tmp_path / "run", name="tiny_pi05", data__max_len=512, steps=3)
    losses = [m["loss"] for m in read_metrics(tmp_path / "run")]
    assert len(losses) == 3 and all(np.isfinite(losses)) and len(set(losses)) == 3
