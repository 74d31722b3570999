"""``omniweave hf verify HF_DIR --audio FILE …`` for audio-language models (Qwen2-Audio).

Called by ``verify.py`` for a directory whose config has an ``audio_config``. The same row goes
through transformers and omniweave and every stage is compared (max|Δ|):

    audio tokens   per encoder item: ours (``data/audio.py``, from the header alone) vs the
                   count transformers derives from its feature mask (``_get_feat_extract_output_lengths``)
    features       ours (``data/mel.log_mel``) vs transformers' ``WhisperFeatureExtractor`` (the
                   directory's ``preprocessor_config.json`` when it has one)
    logits         OmniModel.logits vs transformers' forward (fp32)

Each file is decoded once (``data/audio.load_audio``: mono, 16 kHz) and cut into Qwen2-Audio's
<= 30 s encoder items (``qwen2_audio_chunks``: nothing dropped), every item its own feature row
for both sides. The row is ``text <audio_bos> <audio>×N <audio_eos> text …`` with the token ids
of the config (``foundation.extra_hf["audio"]``); the chat template is not involved, so ids are
ours on both sides. Without ``--audio`` a 3.3 s and a 41 s synthetic tone are used (the second
splits into two items).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from omniweave.data.audio import load_audio, probe_audio, qwen2_audio_chunks, qwen2_audio_tokens
from omniweave.data.mel import SAMPLE_RATE, log_mel
from omniweave.models.hf.loading import adapter_for, load_hf

DEFAULT_SECONDS = (3.3, 41.0)


def synthetic_clips(seed: int) -> list[np.ndarray]:
    """Tones with a little noise, 16 kHz mono float32, of DEFAULT_SECONDS each."""
    rng = np.random.default_rng(seed)
    clips = []
    for i, seconds in enumerate(DEFAULT_SECONDS):
        t = np.arange(round(seconds * SAMPLE_RATE)) / SAMPLE_RATE
        clips.append((0.3 * np.sin(2 * np.pi * (220 + 97 * i) * t) + 0.02 * rng.standard_normal(t.size)).astype(np.float32))
    return clips


def _items(clips: list[np.ndarray]) -> list[np.ndarray]:
    """Every clip cut into its consecutive <= 30 s encoder items, in order."""
    out = []
    for clip in clips:
        cuts = np.cumsum([0, *qwen2_audio_chunks(len(clip))])
        out += [clip[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    return out


def _extractor(hf_dir: Path, n_mels: int):
    from transformers import WhisperFeatureExtractor

    if (hf_dir / "preprocessor_config.json").exists():
        return WhisperFeatureExtractor.from_pretrained(str(hf_dir))
    return WhisperFeatureExtractor(feature_size=n_mels)


def _row(counts: list[list[int]], audio: dict, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [L], audio_spans [items, 2]): random text (ids below the audio token) around
    each clip's <audio_bos> run <audio_eos>, one span per encoder item. A bos / eos id outside the
    vocabulary (tiny test models keep the real ids in the config) is left out."""
    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(0, min(audio["audio_token_id"], vocab), (n,), generator=g)  # noqa: E731
    marks = [torch.tensor([audio[k]] if audio[k] < vocab else [], dtype=torch.long)
             for k in ("audio_bos_token_id", "audio_eos_token_id")]  # fmt: skip
    pieces, spans, at = [text(5)], [], 5
    for clip in counts:
        pieces.append(marks[0])
        at += marks[0].numel()
        for n in clip:  # the items of one clip: consecutive spans
            spans.append((at, n))
            pieces.append(torch.full((n,), audio["audio_token_id"]))
            at += n
        pieces += [marks[1], text(4)]
        at += marks[1].numel() + 4
    return torch.cat(pieces), torch.tensor(spans, dtype=torch.long).reshape(-1, 2)


def verify_audio(args, hf_dir: Path, hf_cfg: dict, report) -> int:
    import transformers

    if args.image or args.video:
        print(f"error: {hf_dir} ({hf_cfg['model_type']}) takes audio only; --image / --video are not for it", file=sys.stderr)
        return 2
    files = [Path(p).read_bytes() for p in args.audio]
    clips = [load_audio(f) for f in files] if files else synthetic_clips(args.seed)
    # token counts as packing computes them: from the header (files) or the sample count (tones)
    lengths = [probe_audio(f).num_samples() for f in files] if files else [len(c) for c in clips]
    counts = [qwen2_audio_tokens(n) for n in lengths]
    items = _items(clips)
    hf_model = getattr(transformers, hf_cfg["architectures"][0]).from_pretrained(
        str(hf_dir), dtype=torch.float32, attn_implementation="eager").eval()  # fmt: skip
    model_cfg = adapter_for(hf_cfg["model_type"]).model_config(hf_cfg)
    n_mels = model_cfg["audio_encoder"]["num_mel_bins"]
    mel = log_mel([torch.from_numpy(c) for c in items], n_mels=n_mels)
    hf_feat = _extractor(hf_dir, n_mels)(list(items), sampling_rate=SAMPLE_RATE, padding="max_length",
                                         return_attention_mask=True, return_tensors="pt")  # fmt: skip
    hf_mask = hf_feat["attention_mask"]
    hf_counts = hf_model.model.audio_tower._get_feat_extract_output_lengths(hf_mask.sum(-1))[1].tolist()
    ours_counts = [n for clip in counts for n in clip]
    rows = [("audio tokens", 0.0 if ours_counts == hf_counts else None,
             f"per item {ours_counts} from {'headers' if files else 'lengths'} (HF {hf_counts}); <= 30 s items")]  # fmt: skip
    same_frames = torch.equal(mel.num_frames, hf_mask.sum(-1))
    rows.append(("features", (mel.features - hf_feat["input_features"]).abs().max().item() if same_frames else None,
                 f"[{len(items)}, {n_mels}, {mel.features.shape[-1]}] log-mel vs WhisperFeatureExtractor"))  # fmt: skip
    if rows[0][1] is None or rows[1][1] is None:
        return report(rows, args.atol)
    ids, spans = _row(counts, model_cfg["foundation"]["extra_hf"]["audio"], model_cfg["foundation"]["vocab_size"], args.seed)
    ours, _ = load_hf(hf_dir)
    ours.eval()
    batch = {"input_ids": ids, "audio_features": mel.features, "audio_lengths": mel.num_frames, "audio_spans": spans,
             "cu_seqlens": torch.tensor([0, ids.numel()], dtype=torch.int32)}  # fmt: skip
    with torch.no_grad():
        ref = hf_model(input_ids=ids[None], input_features=hf_feat["input_features"], feature_attention_mask=hf_mask).logits[0]
        got = ours.logits(batch)
    rows.append(("logits", (ref - got).abs().max().item(), f"[{ref.shape[0]}, {ref.shape[1]}] fp32"))
    return report(rows, args.atol)
