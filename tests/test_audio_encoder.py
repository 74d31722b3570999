"""Audio towers: ours, with every item of a batch in ONE varlen call, equal transformers'
``Qwen2AudioEncoder`` (+ ``multi_modal_projector``) and ``Qwen2_5OmniAudioEncoder`` run per item the
way their models call them, on real log-mel features of synthetic tones: outputs ≤ 1e-5 abs,
gradients wrt the features and every parameter ≤ 1e-4 relative (fp32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.masking_utils import create_bidirectional_mask
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniAudioEncoderConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder
from transformers.models.qwen2_audio.configuration_qwen2_audio import Qwen2AudioEncoderConfig as HFQwen2AudioEncoderConfig
from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder as HFQwen2AudioEncoder

from omniweave.data.media.audio import encoder_tokens
from omniweave.data.media.mel import HOP_LENGTH, SAMPLE_RATE, log_mel
from omniweave.models.components.audio_encoder import pool_pairs
from omniweave.models.registry import build_component
from tests.audio_factory import signal

N_MELS, D, HEADS, FFN, TEXT = 128, 64, 4, 96, 48
# valid mel frames per item: exactly 30 s, 1 s, odd counts (the last position reads a padding
# frame), and a 3-frame item (one output row)
QWEN2_AUDIO_FRAMES = [3000, 100, 777, 3, 1501]
# Qwen2.5-Omni clips: longer than 30 s, not a multiple of the 200-frame chunk, exactly one chunk, tiny
OMNI_FRAMES = [3130, 1234, 200, 5]


def _clips(frames: list[int]) -> list[torch.Tensor]:
    """16 kHz tones of exactly ``f`` mel frames each (f · 160 samples)."""
    return [torch.from_numpy(signal(1.0, SAMPLE_RATE, 1, seed=i)[0]).repeat(f // 100 + 1)[: f * HOP_LENGTH]
            for i, f in enumerate(frames)]  # fmt: skip


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _copy_weights(ours: torch.nn.Module, hf: torch.nn.Module, prefix: str = "") -> None:
    """HF tensors into ours by name (strict both ways: the names are the contract)."""
    ours.load_state_dict({prefix + k: v for k, v in hf.state_dict().items()}, strict=True)


def _hf_qwen2_audio():
    torch.manual_seed(0)
    cfg = HFQwen2AudioEncoderConfig(num_mel_bins=N_MELS, encoder_layers=2, encoder_attention_heads=HEADS,
                                    encoder_ffn_dim=FFN, d_model=D, max_source_positions=1500)  # fmt: skip
    cfg._attn_implementation = "sdpa"  # its 1500 positions per item: eager's backward is the slow part
    tower = HFQwen2AudioEncoder(cfg).eval()
    projector = torch.nn.Linear(D, TEXT)  # Qwen2AudioMultiModalProjector.linear
    return tower, projector


def _hf_qwen2_audio_features(tower, projector, features: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
    """Qwen2AudioModel.forward's audio part: padding keys masked from feature_attention_mask,
    the projected rows of each item's valid tokens, items concatenated."""
    conv_len, out_len = tower._get_feat_extract_output_lengths(frames)
    positions = (features.shape[-1] - 2) // 2 + 1
    mask_2d = (torch.arange(positions)[None, :] < conv_len[:, None]).long()
    mask = create_bidirectional_mask(config=tower.config, inputs_embeds=torch.zeros(len(frames), positions, 1),
                                     attention_mask=mask_2d)  # fmt: skip
    hidden = projector(tower(features, attention_mask=mask).last_hidden_state)
    keep = torch.arange(hidden.shape[1])[None, :] < out_len[:, None]
    return hidden[keep]


def _ours(kind_cfg: dict, proj_cfg: dict):
    enc = build_component("audio_encoder", kind_cfg).eval()
    proj = build_component("audio_projector", proj_cfg)
    return enc, proj


def _grads_match(ours_out, hf_out, ours_inputs, hf_inputs, ours_params, hf_params):
    weight = torch.randn_like(hf_out)
    ours_g = torch.autograd.grad((ours_out * weight).sum(), [*ours_inputs, *ours_params.values()])
    hf_g = torch.autograd.grad((hf_out * weight).sum(), [*hf_inputs, *(hf_params[n] for n in ours_params)])
    names = [f"input {i}" for i in range(len(ours_inputs))] + list(ours_params)
    worst = {n: _rel(a, b) for n, a, b in zip(names, ours_g, hf_g)}
    assert max(worst.values()) <= 1e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


def test_qwen2_audio_tower_and_projector_equal_transformers():
    tower, projector = _hf_qwen2_audio()
    enc, proj = _ours({"name": "qwen2_audio", "num_mel_bins": N_MELS, "num_layers": 2, "hidden_size": D,
                       "num_heads": HEADS, "intermediate_size": FFN, "attn_backend": "sdpa"},
                      {"name": "linear", "in_dim": D, "out_dim": TEXT})  # fmt: skip
    _copy_weights(enc, tower)
    _copy_weights(proj, projector, "linear.")
    mel = log_mel(_clips(QWEN2_AUDIO_FRAMES), n_mels=N_MELS)  # padded to 3000 frames, as the processor does
    assert mel.num_frames.tolist() == QWEN2_AUDIO_FRAMES
    features = mel.features.clone().requires_grad_(True)
    hf_features = mel.features.clone().requires_grad_(True)

    ours = proj(enc(features, mel.num_frames), mel.num_frames)
    ref = torch.cat([_hf_qwen2_audio_features(tower, projector, hf_features[i : i + 1], mel.num_frames[i : i + 1])
                     for i in range(len(QWEN2_AUDIO_FRAMES))])  # fmt: skip
    assert ours.shape == (sum(encoder_tokens(f) for f in QWEN2_AUDIO_FRAMES), TEXT) == ref.shape
    assert proj.num_tokens(mel.num_frames).tolist() == [encoder_tokens(f) for f in QWEN2_AUDIO_FRAMES]
    assert (ours - ref).abs().max() <= 1e-5
    hf_params = {**dict(tower.named_parameters()), **{"linear." + k: v for k, v in projector.named_parameters()}}
    ours_params = {**dict(enc.named_parameters()), **dict(proj.named_parameters())}
    _grads_match(ours, ref, [features], [hf_features], ours_params, hf_params)


def test_qwen2_audio_padding_frames_matter_and_the_rest_is_ignored():
    """An odd valid length reads one padding frame (as transformers does); frames further out
    change nothing, and a window longer than 3000 frames is ignored past 3000."""
    enc, _ = _ours({"name": "qwen2_audio", "num_mel_bins": 8, "num_layers": 1, "hidden_size": 16, "num_heads": 2,
                    "intermediate_size": 24}, {"name": "linear", "in_dim": 16, "out_dim": 8})  # fmt: skip
    x, lengths = torch.randn(1, 8, 3000), torch.tensor([9])
    with torch.no_grad():
        base = enc(x, lengths)
        far = x.clone()
        far[..., 11:] += 1.0
        near = x.clone()
        near[..., 9] += 1.0
        assert torch.equal(enc(far, lengths), base)
        assert not torch.allclose(enc(near, lengths), base)
        assert torch.equal(enc(torch.cat([x, torch.randn(1, 8, 50)], -1), lengths), base)


def test_qwen2_5_omni_tower_equals_transformers():
    torch.manual_seed(0)
    cfg = Qwen2_5OmniAudioEncoderConfig(num_mel_bins=N_MELS, encoder_layers=2, encoder_attention_heads=HEADS,
                                        encoder_ffn_dim=FFN, d_model=D, n_window=100, output_dim=TEXT)  # fmt: skip
    cfg._attn_implementation = "eager"
    tower = Qwen2_5OmniAudioEncoder(cfg).eval()
    enc, proj = _ours({"name": "qwen2_5_omni", "num_mel_bins": N_MELS, "num_layers": 2, "hidden_size": D,
                       "num_heads": HEADS, "intermediate_size": FFN, "n_window": 100, "output_dim": TEXT,
                       "attn_backend": "sdpa"}, {"name": "identity", "dim": TEXT})  # fmt: skip
    _copy_weights(enc, tower)
    # whole clips, each padded to max(its length, 30 s) (truncation=False: nothing cut at 30 s)
    mel = log_mel(_clips(OMNI_FRAMES), n_mels=N_MELS, truncation=False)
    assert mel.num_frames.tolist() == OMNI_FRAMES and mel.features.shape[-1] > 3000
    features = mel.features.clone().requires_grad_(True)
    hf_features = mel.features.clone().requires_grad_(True)

    ours = proj(enc(features, mel.num_frames), mel.num_frames)
    # Qwen2_5OmniThinker: the valid frames of each clip, concatenated [n_mels, Σ frames]
    ref = torch.cat([tower(hf_features[i, :, :f], feature_lens=torch.tensor([f])).last_hidden_state
                     for i, f in enumerate(OMNI_FRAMES)])  # fmt: skip
    assert ours.shape == (sum(encoder_tokens(f) for f in OMNI_FRAMES), TEXT) == ref.shape
    assert (ours - ref).abs().max() <= 1e-5
    # and transformers' own batched call (all clips in one input) agrees too
    with torch.no_grad():
        joint = torch.cat([mel.features[i, :, :f] for i, f in enumerate(OMNI_FRAMES)], dim=1)
        batched = tower(joint, feature_lens=mel.num_frames).last_hidden_state
    assert (ours.detach() - batched).abs().max() <= 1e-5
    _grads_match(ours, ref, [features], [hf_features], dict(enc.named_parameters()), dict(tower.named_parameters()))


def test_pool_pairs_equal_transformers_pool_indices():
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import get_pool_indices

    frames = torch.tensor([3, 4, 5, 200, 777, 3130])
    assert torch.equal(pool_pairs((frames - 1) // 2 + 1), get_pool_indices(frames))


@pytest.mark.parametrize("name", ["qwen2_audio", "qwen2_5_omni"])
def test_dummy_input_is_a_valid_one_row_item(name):
    enc, _ = _ours({"name": name, "num_mel_bins": 8, "num_layers": 1, "hidden_size": 16, "num_heads": 2,
                    "intermediate_size": 24, **({"output_dim": 12} if name == "qwen2_5_omni" else {})},
                   {"name": "identity", "dim": 16})  # fmt: skip
    features, lengths = enc.dummy_input()
    assert enc(features, lengths).shape == (1, enc.out_dim)


def test_bad_audio_input_raises_clearly():
    enc, _ = _ours({"name": "qwen2_audio", "num_mel_bins": 8, "num_layers": 1, "hidden_size": 16, "num_heads": 2,
                    "intermediate_size": 24}, {"name": "identity", "dim": 16})  # fmt: skip
    with pytest.raises(ValueError, match="mel bins"):
        enc(torch.zeros(1, 7, 3000), torch.tensor([10]))
    with pytest.raises(ValueError, match="audio_lengths"):
        enc(torch.zeros(2, 8, 3000), torch.tensor([10]))
    with pytest.raises(ValueError, match=r"must lie in \[1, 3000\]"):
        enc(torch.zeros(1, 8, 3000), torch.tensor([0]))
    with pytest.raises(ValueError, match="these items read 21"):
        enc(torch.zeros(1, 8, 20), torch.tensor([20]))


@pytest.mark.parametrize("tower,projector", [("qwen2_audio", "linear"), ("qwen2_5_omni", "identity")])
@pytest.mark.parametrize("size", ["_tiny", ""])
def test_shipped_yamls_build_and_fit_together(tower, projector, size):
    """omniweave/configs/models/audio_{encoder,projector}: every key is a config field, and the projector's
    width follows the encoder and the foundation through interpolation."""
    import yaml
    from omegaconf import OmegaConf

    from omniweave.models.registry import build_config

    models = Path(__file__).resolve().parents[1] / "omniweave/configs/models"
    cfg = OmegaConf.create({"model": {
        "foundation": yaml.safe_load((models / "foundation/qwen2_tiny.yaml").read_text()),
        "audio_encoder": yaml.safe_load((models / f"audio_encoder/{tower}{size}.yaml").read_text()),
        "audio_projector": yaml.safe_load((models / f"audio_projector/{projector}.yaml").read_text()),
    }})  # fmt: skip
    model = OmegaConf.to_container(cfg, resolve=True)["model"]
    enc, proj = build_config("audio_encoder", model["audio_encoder"]), build_config("audio_projector", model["audio_projector"])
    width = getattr(enc, "output_dim", enc.hidden_size)
    assert getattr(proj, "in_dim", width) == width
    assert getattr(proj, "out_dim", getattr(proj, "dim", None)) == model["foundation"]["hidden_size"]
    if size:  # the tiny ones are cheap enough to build and run
        e, p = build_component("audio_encoder", model["audio_encoder"]), build_component("audio_projector", model["audio_projector"])
        features, lengths = e.dummy_input()
        assert p(e(features, lengths), lengths).shape == (1, model["foundation"]["hidden_size"])


@pytest.mark.parametrize("name", ["qwen2_audio", "qwen2_5_omni"])
def test_init_weights_after_meta_to_empty_restores_the_position_tables(name):
    """FSDP builds on the meta device and materialises with to_empty: init_weights must refill the
    non-trainable tables (buffers) as well as the parameters."""
    from omniweave.models.components.audio_encoder import sinusoids

    cfg = {"name": name, "num_mel_bins": 8, "num_layers": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 24,
           "max_source_positions": 60, **({"output_dim": 12, "n_window": 10} if name == "qwen2_5_omni" else {})}  # fmt: skip
    with torch.device("meta"):
        enc = build_component("audio_encoder", cfg)
    enc.to_empty(device="cpu")
    enc.init_weights()
    table = enc.embed_positions if name == "qwen2_audio" else enc.positional_embedding
    assert torch.equal(table.weight, sinusoids(60, 16))
    assert all(torch.isfinite(t).all() for t in enc.state_dict().values())
    features, lengths = enc.dummy_input()
    assert torch.isfinite(enc(features, lengths)).all()
    persistent = set(enc.state_dict())
    assert ("embed_positions.weight" in persistent) == (name == "qwen2_audio")  # HF saves it; Omni's is recomputed
    assert ("audio_bos_eos_token.weight" in persistent) == (name == "qwen2_5_omni")
