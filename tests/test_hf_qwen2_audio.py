"""Qwen2-Audio HF adapter: a tiny ``Qwen2AudioForConditionalGeneration``'s tensors (as
``save_pretrained`` writes them, and transformers 5's in-memory names) map onto exactly our
components' parameters and back to identical HF tensors; the config round-trips both ways."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

from omniweave.models.hf.loading import adapter_for
from omniweave.models.registry import build_component, build_config
from tests.hf_factory import perturb_norms_and_biases

AUDIO = dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=72, d_model=40)
TEXT = dict(vocab_size=1024, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
AUDIO_TOKEN = 693  # the demo tokenizer's <|AUDIO|> (692 / 694: <|audio_bos|> / <|audio_eos|>)


def tiny_qwen2_audio(seed: int = 0) -> Qwen2AudioForConditionalGeneration:
    """Random tiny model with non-unit norms and non-zero biases, so every tensor matters."""
    torch.manual_seed(seed)
    cfg = Qwen2AudioConfig(audio_config=AUDIO, text_config=TEXT, audio_token_index=AUDIO_TOKEN)
    model = Qwen2AudioForConditionalGeneration(cfg).float().eval()
    perturb_norms_and_biases(model)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_audio")
    model = tiny_qwen2_audio()
    model.save_pretrained(path)
    return model, path


def _our_parameter_shapes(model_cfg: dict) -> dict[str, tuple]:
    """Every tensor our model keeps (state_dict: parameters and persistent buffers), by name."""
    shapes = {}
    for kind in ("foundation", "audio_encoder", "audio_projector"):
        with torch.device("meta"):
            part = build_component(kind, model_cfg[kind])
        shapes.update({f"{kind}.{n}": tuple(t.shape) for n, t in part.state_dict().items()})
    return shapes


def test_saved_tensors_map_onto_our_parameters_and_back(saved):
    model, path = saved
    adapter = adapter_for("qwen2_audio")
    model_cfg = adapter.model_config(model.config.to_dict())
    hf = load_file(str(path / "model.safetensors"))
    assert "audio_tower.conv1.weight" in hf and "language_model.lm_head.weight" in hf  # the checkpoint layout
    ours = {adapter.model_name_to_ours(n): t for n, t in hf.items()}
    assert {n: tuple(t.shape) for n, t in ours.items()} == _our_parameter_shapes(model_cfg)
    back = {adapter.model_name_to_hf(n): t for n, t in ours.items()}
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[n], hf[n]) for n in hf)


def test_in_memory_names_map_like_the_saved_ones(saved):
    """transformers 5's module names (model.audio_tower…, lm_head) reach the same tensors of ours."""
    model, path = saved
    adapter = adapter_for("qwen2_audio")
    hf = load_file(str(path / "model.safetensors"))
    from_saved = {adapter.model_name_to_ours(n): t for n, t in hf.items()}
    from_memory = {adapter.model_name_to_ours(n): t for n, t in model.state_dict().items()}
    assert from_memory.keys() == from_saved.keys()
    assert all(torch.equal(from_memory[n], from_saved[n]) for n in from_saved)


def _built(model_cfg: dict):
    return [build_config(kind, model_cfg[kind]) for kind in ("foundation", "audio_encoder", "audio_projector")]


def test_config_round_trips(saved):
    model, _ = saved
    adapter = adapter_for("qwen2_audio")
    hf = model.config.to_dict()
    ours = adapter.model_config(hf)
    assert ours["audio_encoder"] == {"name": "qwen2_audio", "num_mel_bins": 128, "num_layers": 2, "hidden_size": 40,
                                     "num_heads": 4, "intermediate_size": 72, "max_source_positions": 1500,
                                     "activation": "gelu"}  # fmt: skip
    assert ours["audio_projector"] == {"name": "linear", "in_dim": 40, "out_dim": 48}
    assert ours["foundation"]["extra_hf"]["audio"] == {"audio_token_id": AUDIO_TOKEN, "audio_bos_token_id": 151647,
                                                       "audio_eos_token_id": 151648}  # fmt: skip
    assert ours["foundation"]["tie_word_embeddings"] is False
    back = adapter.model_config_to_hf(*_built(ours))
    # transformers reads our config as the same model: same sub-configs, same token id
    again = Qwen2AudioConfig(**{k: v for k, v in back.items() if k not in ("architectures", "model_type")})
    for sub in ("audio_config", "text_config"):
        theirs, mine = getattr(model.config, sub).to_dict(), getattr(again, sub).to_dict()
        diff = {k: (theirs.get(k), mine.get(k)) for k in theirs.keys() | mine.keys()
                if k not in ("dtype", "torch_dtype", "transformers_version") and theirs.get(k) != mine.get(k)}  # fmt: skip
        if sub == "text_config":  # we write head_dim out; transformers derives the same value
            assert diff.pop("head_dim", (None, 48 // 4)) == (None, 48 // 4)
        assert not diff, (sub, diff)
    assert again.audio_token_id == AUDIO_TOKEN and back["architectures"] == ["Qwen2AudioForConditionalGeneration"]
    assert adapter.model_config(back) == ours  # ours -> HF -> ours is the identity


def test_a_tied_foundation_exports_untied_with_its_head():
    """transformers' Qwen2-Audio never ties: a foundation trained tied is written with the head."""
    adapter = adapter_for("qwen2_audio")
    ours = adapter.model_config(tiny_qwen2_audio().config.to_dict())
    ours["foundation"]["tie_word_embeddings"] = True
    back = adapter.model_config_to_hf(*_built(ours))
    assert back["text_config"]["tie_word_embeddings"] is False
    assert adapter.name_to_hf("foundation.lm_head.weight") == "language_model.lm_head.weight"


def test_wrong_parts_and_unknown_tensors_raise():
    adapter = adapter_for("qwen2_audio")
    ours = adapter.model_config(tiny_qwen2_audio().config.to_dict())
    ours["audio_projector"] = {"name": "identity", "dim": 48}
    with pytest.raises(ValueError, match="linear audio_projector"):
        adapter.model_config_to_hf(*_built(ours))
    with pytest.raises(KeyError, match="unexpected tensor"):
        adapter.model_name_to_ours("visual.blocks.0.attn.qkv.weight")
    with pytest.raises(ValueError, match="text model"):
        adapter.model_config({"text_config": {"model_type": "llama"}})


# ----------------------------------------------------------------------------- whole-model parity

AUDIO_BOS, AUDIO_EOS = 692, 694
CLIP_SECONDS = (2.37, 7.0)


def audio_sample(seed: int = 0, text: int = 6) -> dict:
    """One packed row: text, then per clip <audio_bos> <audio>×N <audio_eos> + text, and the clips'
    log-mel features padded to 30 s as Qwen2AudioProcessor pads them."""
    from omniweave.data.media.mel import SAMPLE_RATE, log_mel
    from omniweave.data.media.audio import encoder_tokens
    from tests.audio_factory import signal

    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(10, 600, (n,), generator=g)  # noqa: E731
    clips = [torch.from_numpy(signal(s, SAMPLE_RATE, 1, seed=seed + i)[0]) for i, s in enumerate(CLIP_SECONDS)]
    mel = log_mel(clips, n_mels=128)
    ids, spans = [rand(text)], []
    for frames in mel.num_frames.tolist():
        n = encoder_tokens(frames)
        ids.append(torch.tensor([AUDIO_BOS]))
        spans.append((sum(x.numel() for x in ids), n))
        ids += [torch.full((n,), AUDIO_TOKEN), torch.tensor([AUDIO_EOS]), rand(text)]
    input_ids = torch.cat(ids)
    return {"input_ids": input_ids, "audio_features": mel.features, "audio_lengths": mel.num_frames,
            "audio_spans": torch.tensor(spans), "feature_attention_mask": mel.attention_mask()}  # fmt: skip


def _batch(sample: dict) -> dict:
    """Our batch keys (registry.MODALITIES audio): features, valid frames, placeholder spans."""
    keys = ("input_ids", "audio_features", "audio_lengths", "audio_spans")
    return {**{k: sample[k] for k in keys}, "cu_seqlens": torch.tensor([0, sample["input_ids"].numel()], dtype=torch.int32)}


def _hf_forward(hf, sample: dict):
    return hf(input_ids=sample["input_ids"][None], input_features=sample["audio_features"],
              feature_attention_mask=sample["feature_attention_mask"]).logits[0]  # fmt: skip


@pytest.fixture(scope="module")
def ours(saved):
    from omniweave.models.hf.loading import load_hf

    model, model_cfg = load_hf(saved[1])
    return model.eval(), model_cfg


def test_logits_and_grads_equal_transformers_with_two_clips_in_one_row(saved, ours):
    """OmniModel built by load_hf (registry.build_model of foundation + audio_encoder +
    audio_projector) vs Qwen2AudioForConditionalGeneration: text and two clips in one row."""
    hf, _ = saved
    model, _ = ours
    sample = audio_sample()
    hf.zero_grad(), model.zero_grad()
    ref = _hf_forward(hf, sample)
    got = model.logits(_batch(sample))
    assert got.shape == ref.shape
    assert (got - ref).abs().max() <= 1e-5
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    (ref * weights).sum().backward()
    (got * weights).sum().backward()
    adapter = adapter_for("qwen2_audio")
    hf_grads = {adapter.model_name_to_ours(n): p.grad for n, p in hf.named_parameters() if p.grad is not None}
    worst, checked = 0.0, set()
    for name, p in model.named_parameters():
        g_ref = hf_grads.get(name)
        if g_ref is None or g_ref.norm() == 0:
            continue
        worst = max(worst, float((p.grad - g_ref).norm() / g_ref.norm()))
        checked.add(name.split(".")[0])
    assert worst <= 1e-4
    assert checked == {"foundation", "audio_encoder", "audio_projector"}


def test_a_row_without_audio_runs_the_dummy_item_and_equals_transformers(saved, ours):
    """No audio in the row: the tower still runs (FSDP collectives) and changes nothing."""
    hf, _ = saved
    model, _ = ours
    ids = torch.randint(10, 600, (17,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0]
        got = model.logits({"input_ids": ids})
    assert (got - ref).abs().max() <= 1e-5


def test_export_writes_what_transformers_loads_back_identically(saved, ours, tmp_path):
    from omniweave.models.hf.export import export_hf

    hf, path = saved
    model, model_cfg = ours
    export_hf(model, model_cfg, tmp_path)
    original, exported = load_file(str(path / "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[n], original[n]) for n in original)
    again = Qwen2AudioForConditionalGeneration.from_pretrained(tmp_path).eval()
    sample = audio_sample(seed=1)
    with torch.no_grad():
        assert torch.equal(_hf_forward(again, sample), _hf_forward(hf, sample))


def test_hf_verify_audio_files_and_perturbed_weights(saved, tmp_path, monkeypatch, capsys):
    """``omniweave hf verify DIR --audio FILE``: a conversation with a 35 s wav (two encoder items)
    and a 2 s mp3 through our data pipeline agrees with transformers on token counts planned from
    headers, mel features, positions and logits; a perturbed projector fails."""
    from omniweave.cli import main
    from omniweave.models.hf import verify_audio
    from tests.audio_factory import encode, signal

    _, path = saved
    files = []
    for name, seconds, rate, fmt in (("long.wav", 35.0, 22050, "wav"), ("short.mp3", 2.0, 44100, "mp3")):
        files += ["--audio", str(tmp_path / name)]
        (tmp_path / name).write_bytes(encode(signal(seconds, rate, 2, seed=len(files)), rate, fmt))
    assert main(["hf", "verify", str(path), *files]) == 0
    out = capsys.readouterr().out
    assert "planned from headers" in out and "OK: all differences" in out
    assert "[3, 128, 3000]" in out  # three encoder items: the 35 s clip is two

    real_load = verify_audio.load_hf

    def perturbed(hf_dir):
        model, cfg = real_load(hf_dir)
        with torch.no_grad():
            model.audio_projector.linear.weight.mul_(1.5)
        return model, cfg

    monkeypatch.setattr(verify_audio, "load_hf", perturbed)
    assert main(["hf", "verify", str(path), *files]) == 1
    assert "FAIL: logits" in capsys.readouterr().out
    assert main(["hf", "verify", str(path), "--image", "x.png"]) == 2


def test_export_with_its_recipe_is_a_whole_qwen2_audio_directory(ours, tmp_path):
    """With the recipe's data section: the audio token id comes from its tokenizer (the demo
    tokenizer's <|AUDIO|>), and
    AutoProcessor loads Qwen2AudioProcessor whose features equal ours (data/mel.log_mel)."""
    import json

    from transformers import AutoProcessor

    from omniweave.data.media.mel import log_mel
    from omniweave.models.hf.export import export_hf
    from tests.audio_factory import signal

    model, model_cfg = ours
    out = export_hf(model, model_cfg, tmp_path / "hf", data_cfg={"tokenizer": "demo", "template": "chatml"})
    audio_id = json.loads((out / "config.json").read_text())["audio_token_index"]
    assert audio_id == AUDIO_TOKEN  # the demo tokenizer's <|AUDIO|>
    processor = AutoProcessor.from_pretrained(out)
    assert type(processor).__name__ == "Qwen2AudioProcessor" and processor.audio_token_id == audio_id
    clip = signal(4.2, 16000, 1, seed=5)[0]
    theirs = processor.feature_extractor(clip, sampling_rate=16000, padding="max_length", return_tensors="pt")
    assert (log_mel([torch.from_numpy(clip)], n_mels=128).features - theirs["input_features"]).abs().max() <= 1e-4


def test_tiny_recipe_trains_on_a_pipeline_batch_and_exports_as_qwen2_audio(tmp_path):
    """omniweave/configs/recipes/tiny_qwen2_audio.yaml composes, builds (foundation + audio_encoder +
    audio_projector), takes the loader's audio batch of a conversation with a 35 s clip (two
    encoder items) with gradients reaching the tower, and exports as a directory transformers loads."""
    from omniweave.config import load_recipe, to_dict
    from omniweave.data.loading.loader import media_batch
    from omniweave.data.sample import Conversation, Message, RawSample
    from omniweave.data.text.tokenize import SampleProcessor
    from omniweave.models.hf.export import export_hf
    from omniweave.models.registry import build_model
    from tests.audio_factory import encode, signal

    cfg = to_dict(load_recipe("tiny_qwen2_audio"))
    torch.manual_seed(0)
    model = build_model(cfg["model"])
    media = {"aud0.wav": encode(signal(35.0, 16000, 1), 16000, "wav"), "aud1.wav": encode(signal(1.5, 16000, 1, seed=1), 16000, "wav")}
    conv = Conversation(id="t", messages=[Message("user", "<audio>Then<audio>What is it?"), Message("assistant", "A tone.")],
                        audios=list(media))  # fmt: skip
    proc = SampleProcessor(cfg["data"])
    sample = proc.tokenize(RawSample(key="t", conversation=conv, media=media))
    batch = {"input_ids": torch.from_numpy(sample.input_ids.astype("int64")),
             "labels": torch.from_numpy(sample.labels.astype("int64")).roll(-1),  # next-token labels, as packing shifts them
             "position_ids": torch.from_numpy(sample.position_ids.astype("int64")),
             **media_batch(proc, [(s, media[s.part]) for s in sample.media])}  # fmt: skip
    assert batch["audio_lengths"].tolist() == [1750, 1750, 150]  # 35 s -> two 17.5 s items
    out = model(batch)
    out.loss_sum.backward()
    assert torch.isfinite(out.loss_sum) and int(out.num_tokens) > 0
    assert model.audio_encoder.conv1.weight.grad.abs().sum() > 0
    export_hf(model, cfg["model"], tmp_path, data_cfg=cfg["data"])
    hf = Qwen2AudioForConditionalGeneration.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert (hf(input_ids=batch["input_ids"][None]).logits[0] - model.logits({"input_ids": batch["input_ids"]})).abs().max() <= 1e-5
