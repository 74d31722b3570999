"""``omniweave hf verify HF_DIR --audio FILE …`` for audio-language models (Qwen2-Audio).

Called by ``verify.py`` for a directory whose config has an ``audio_config``. One conversation
(``<audio>`` per file, then ``--prompt``, and an answer) goes through our data pipeline exactly as
training sees it (``SampleProcessor`` with ``data.audio``, ``loader.media_batch``) and through
transformers, and every stage is compared (max|Δ|):

    audio tokens   per encoder item: ours (planned from the file header at tokenize time) vs the
                   count transformers derives from its feature mask (``_get_feat_extract_output_lengths``)
    features       ours (``media_batch``: ``data/mel.log_mel``) vs transformers' ``WhisperFeatureExtractor``
                   (the directory's ``preprocessor_config.json`` when it has one) on the same items
    position_ids   ours (``rope1d``) vs the ``arange`` transformers uses
    logits         OmniModel.logits vs transformers' forward (fp32), on our input_ids

Qwen2-Audio's processor truncates audio at 30 s; we cut a longer clip into <= 30 s encoder items
(``data/media/audio.py``), each its own feature row and pad run, so transformers is given the same items
and the same ids (its ``masked_scatter`` fills the pad runs in order). The tokenizer is the
directory's (tokenizer.json) or omniweave's demo tokenizer; its ``<|AUDIO|>`` id must equal the
config's ``audio_token_index``. Without ``--audio``, a 3.3 s and a 41 s synthetic tone (the second
two encoder items) are used.
"""

from __future__ import annotations

import io
import sys
import wave
from pathlib import Path

import numpy as np
import torch

from omniweave.data.media.mel import SAMPLE_RATE
from omniweave.data.text.hf_template import verify_template
from omniweave.models.hf.loading import adapter_for, load_hf

DEFAULT_SECONDS = (3.3, 41.0)


def synthetic_wavs(seed: int) -> list[bytes]:
    """16 kHz mono 16-bit WAV files of tones with a little noise, DEFAULT_SECONDS long."""
    rng = np.random.default_rng(seed)
    files = []
    for i, seconds in enumerate(DEFAULT_SECONDS):
        t = np.arange(round(seconds * SAMPLE_RATE)) / SAMPLE_RATE
        x = 0.3 * np.sin(2 * np.pi * (220 + 97 * i) * t) + 0.02 * rng.standard_normal(t.size)
        buf = io.BytesIO()
        with wave.open(buf, "wb") as w:
            w.setnchannels(1), w.setsampwidth(2), w.setframerate(SAMPLE_RATE)
            w.writeframes((x * 32767).astype("<i2").tobytes())
        files.append(buf.getvalue())
    return files


def _sample(args, hf_dir: Path, n_mels: int, files: list[bytes]):
    """(processor, tokenized sample, the row's audio tensors) from our data pipeline."""
    from omniweave.data.loading.loader import media_batch
    from omniweave.data.sample import Conversation, Message, RawSample
    from omniweave.data.text.tokenize import SampleProcessor

    media = {f"aud{i}.wav": b for i, b in enumerate(files)}
    conv = Conversation(id="verify", messages=[Message("user", "<audio>" * len(files) + args.prompt),
                                               Message("assistant", "A sound.")], audios=list(media))  # fmt: skip
    tokenizer = str(hf_dir) if (hf_dir / "tokenizer.json").exists() else "demo"
    template = verify_template(args.template, tokenizer)
    proc = SampleProcessor({"tokenizer": tokenizer, "template": template, "max_len": 1 << 20, "rope": "rope1d",
                            "audio": {"family": "qwen2_audio", "n_mels": n_mels}})  # fmt: skip
    sample = proc.tokenize(RawSample(key="verify", conversation=conv, media=media))
    return proc, sample, media_batch(proc, [(s, media[s.part]) for s in sample.media])


def _hf_features(hf_dir: Path, n_mels: int, proc, sample, media: dict) -> dict:
    """transformers' feature extractor on the same encoder items (decoded and cut by our pipeline)."""
    from transformers import WhisperFeatureExtractor

    extractor = (WhisperFeatureExtractor.from_pretrained(str(hf_dir)) if (hf_dir / "preprocessor_config.json").exists()
                 else WhisperFeatureExtractor(feature_size=n_mels))  # fmt: skip
    items = [item for s in sample.media for item in proc.process_audio(s, media[s.part])]
    return extractor(items, sampling_rate=SAMPLE_RATE, padding="max_length", return_attention_mask=True, return_tensors="pt")


def verify_audio(args, hf_dir: Path, hf_cfg: dict, report) -> int:
    import transformers

    if args.image or args.video:
        print(f"error: {hf_dir} ({hf_cfg['model_type']}) takes audio only; --image / --video are not for it", file=sys.stderr)
        return 2
    model_cfg = adapter_for(hf_cfg["model_type"]).model_config(hf_cfg)
    n_mels = model_cfg["audio_encoder"]["num_mel_bins"]
    files = [Path(p).read_bytes() for p in args.audio] or synthetic_wavs(args.seed)
    proc, sample, ours_audio = _sample(args, hf_dir, n_mels, files)
    if proc.audio_pad_id != model_cfg["foundation"]["extra_hf"]["audio"]["audio_token_id"]:
        print(f"error: config audio_token_index={hf_cfg.get('audio_token_index')} but the tokenizer's "
              f"{proc.template.audio_pad} id is {proc.audio_pad_id}", file=sys.stderr)  # fmt: skip
        return 2
    media = {f"aud{i}.wav": b for i, b in enumerate(files)}
    hf_feat = _hf_features(hf_dir, n_mels, proc, sample, media)
    hf_model = getattr(transformers, hf_cfg["architectures"][0]).from_pretrained(
        str(hf_dir), dtype=torch.float32, attn_implementation="eager").eval()  # fmt: skip
    hf_mask = hf_feat["attention_mask"]
    hf_counts = hf_model.model.audio_tower._get_feat_extract_output_lengths(hf_mask.sum(-1))[1].tolist()
    ours_counts = ours_audio["audio_spans"][:, 1].tolist()
    rows = [("audio tokens", 0.0 if ours_counts == hf_counts else None,
             f"per encoder item {ours_counts} planned from headers (HF {hf_counts})")]  # fmt: skip
    same_frames = torch.equal(ours_audio["audio_lengths"], hf_mask.sum(-1))
    diff = (ours_audio["audio_features"] - hf_feat["input_features"]).abs().max().item() if same_frames else None
    rows.append(("features", diff, f"{list(ours_audio['audio_features'].shape)} log-mel vs WhisperFeatureExtractor"))
    ids = torch.from_numpy(sample.input_ids.astype(np.int64))
    pos = torch.from_numpy(sample.position_ids.astype(np.int64)).reshape(-1, ids.numel())
    rows.append(("position_ids", (pos - torch.arange(ids.numel())).abs().max().item(), f"1-D, L={ids.numel()}"))
    if rows[0][1] is None or diff is None:
        return report(rows, args.atol)
    ours, _ = load_hf(hf_dir)
    ours.eval()
    batch = {"input_ids": ids, "position_ids": pos, "cu_seqlens": torch.tensor([0, ids.numel()], dtype=torch.int32),
             **ours_audio}  # fmt: skip
    with torch.no_grad():
        ref = hf_model(input_ids=ids[None], input_features=hf_feat["input_features"], feature_attention_mask=hf_mask).logits[0]
        got = ours.logits(batch)
    rows.append(("logits", (ref - got).abs().max().item(), f"[{ref.shape[0]}, {ref.shape[1]}] fp32"))
    return report(rows, args.atol)
