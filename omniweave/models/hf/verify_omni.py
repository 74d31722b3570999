"""``omniweave hf verify HF_DIR [--audio FILE …] [--image FILE …] [--video FILE …]`` for the
Qwen2.5-Omni thinker (a ``qwen2_5_omni_thinker`` directory, or a full ``qwen2_5_omni`` one: its thinker).

Called by ``verify.py`` for those model types. One conversation (``<image>``, ``<audio>``,
``<video>`` per file in that order, then ``--prompt``, and an answer) goes through our data pipeline
(``SampleProcessor`` with ``data.vision`` and ``data.audio`` family ``qwen2_5_omni``,
``loader.media_batch``) and through transformers, and every stage is compared (max|Δ|):

    audio tokens   per clip: ours (planned from the file header at tokenize time) vs the count
                   transformers derives from its feature mask (``_get_feat_extract_output_lengths``)
    features       ours (``data/mel.log_mel``) vs transformers' ``WhisperFeatureExtractor`` on the same
                   decoded clips (``truncation=False``: a clip keeps all its frames), valid frames only
    logits         OmniModel.logits vs transformers' thinker forward (fp32), on our input_ids

``--use-audio-in-video``: each ``--video`` carries its own sound track, which becomes an audio
input too (our side: ``data.audio.use_audio_in_video``, its pads interleaved with the video's in
``seconds_per_chunk`` chunks; transformers: the same decoded track through
``WhisperFeatureExtractor`` and ``use_audio_in_video=True`` for ``get_rope_index`` and the
forward). A video without an audio stream is refused (exit 2, reason ``no_audio_stream``), as the
data pipeline rejects it.

Pixels: ours are fed to both (our resize rules are checked against transformers' processors by the
Qwen2.5-VL verify). Positions: ours (``rope: mrope_omni``, planned
offline) must equal transformers' ``get_rope_index`` (TMRoPE) on the same ids; each model runs on
its own. Without media files, the Qwen2.5-VL verify's
random image and clip and Qwen2-Audio's 3.3 s and 41 s synthetic tones are used.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from omniweave.data.media.mel import SAMPLE_RATE
from omniweave.data.text.hf_template import verify_template
from omniweave.models.hf.loading import adapter_for, load_hf


def _media(args) -> dict[str, list[bytes]]:
    from omniweave.models.hf.verify import random_media
    from omniweave.models.hf.verify_audio import synthetic_wavs

    media = {kind: [Path(p).read_bytes() for p in getattr(args, kind)] for kind in ("image", "audio", "video")}
    if not any(media.values()):
        image, video = random_media(args.seed)
        media = {"image": [image], "audio": synthetic_wavs(args.seed), "video": [video]}
    return media


def _sample(args, hf_dir: Path, model_cfg: dict, media: dict[str, list[bytes]]):
    """(processor, raw sample, tokenized sample) from our data pipeline, TMRoPE positions included
    (``rope: mrope_omni`` with the thinker's time scale)."""
    from omniweave.data.sample import Conversation, Message, RawSample
    from omniweave.data.text.tokenize import SampleProcessor

    files = {f"{kind}{i}.bin": b for kind, items in media.items() for i, b in enumerate(items)}
    conv = Conversation(id="verify", messages=[
        Message("user", "".join(f"<{kind}>" * len(items) for kind, items in media.items()) + args.prompt),
        Message("assistant", "A picture, a sound and a clip.")],
        **{f"{kind}s": [k for k in files if k.startswith(kind)] for kind in media})  # fmt: skip
    enc = model_cfg["image_encoder"]
    vision = {"patch_size": enc["patch_size"], "temporal_patch_size": enc["temporal_patch_size"],
              "merge_size": enc["spatial_merge_size"]}  # fmt: skip
    tokenizer = str(hf_dir) if (hf_dir / "tokenizer.json").exists() else "demo"
    omni = model_cfg["foundation"]["extra_hf"]["omni"]
    vision["position_id_per_seconds"] = omni.get("position_id_per_seconds", 25)
    audio = {"family": "qwen2_5_omni", "n_mels": model_cfg["audio_encoder"]["num_mel_bins"],
             "seconds_per_chunk": omni.get("seconds_per_chunk", 2), "use_audio_in_video": args.use_audio_in_video}
    template = verify_template(args.template, tokenizer)
    proc = SampleProcessor({"tokenizer": tokenizer, "template": template, "max_len": 1 << 20, "rope": "mrope_omni",
                            "vision": vision, "audio": audio})  # fmt: skip
    raw = RawSample(key="verify", conversation=conv, media=files)
    return proc, raw, proc.tokenize(raw)


def _token_id_errors(proc, omni: dict) -> list[str]:
    """Config token ids that differ from the tokenizer's (transformers finds the spans by them)."""
    tok, tpl = proc.tokenizer, proc.template
    starts = {"vision_start_token_id": tpl.image.split(tpl.image_pad)[0], "audio_start_token_id": tpl.audio.split(tpl.audio_pad)[0]}
    pairs = (("image_token_index", proc.image_pad_id), ("video_token_index", proc.video_pad_id),
             ("audio_token_index", proc.audio_pad_id),
             *((key, tok.token_id(t) if tok.has_token(t) else None) for key, t in starts.items()))  # fmt: skip
    return [f"config {key}={omni.get(key)} but the tokenizer's id is {ours}" for key, ours in pairs if omni.get(key) != ours]


def _hf_features(proc, sample, raw, n_mels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' log-mel of our decoded clips, one at a time (``truncation=False``), zero-padded to
    one width: (input_features [A, n_mels, W], feature_attention_mask [A, W])."""
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=n_mels)
    items = [item for s in sample.media if s.kind == "audio" for item in proc.process_audio(s, raw.media[s.part])]
    out = [extractor(x, sampling_rate=SAMPLE_RATE, padding="max_length", truncation=False, return_attention_mask=True,
                     return_tensors="pt") for x in items]  # fmt: skip
    width = max(o["input_features"].shape[-1] for o in out)
    features = torch.cat([torch.nn.functional.pad(o["input_features"], (0, width - o["input_features"].shape[-1])) for o in out])
    mask = torch.cat([torch.nn.functional.pad(o["attention_mask"], (0, width - o["attention_mask"].shape[-1])) for o in out])
    return features, mask


def _hf_thinker(hf_dir: Path, hf_cfg: dict):
    import transformers

    if hf_cfg["model_type"] == "qwen2_5_omni":  # the full model without its talker: only the thinker is built
        full = transformers.Qwen2_5OmniForConditionalGeneration.from_pretrained(
            str(hf_dir), dtype=torch.float32, enable_audio_output=False, attn_implementation="eager")  # fmt: skip
        return full.thinker.eval()
    return transformers.Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(
        str(hf_dir), dtype=torch.float32, attn_implementation="eager").eval()  # fmt: skip


def verify_omni(args, hf_dir: Path, hf_cfg: dict, report) -> int:
    from omniweave.data.loading.loader import media_batch
    from omniweave.data.text.tokenize import SampleRejected

    if args.use_audio_in_video and not args.video:
        print("error: --use-audio-in-video needs --video files that carry a sound track", file=sys.stderr)
        return 2
    model_cfg = adapter_for(hf_cfg["model_type"]).model_config(hf_cfg)
    omni = model_cfg["foundation"]["extra_hf"]["omni"]
    media = _media(args)
    try:
        proc, raw, sample = _sample(args, hf_dir, model_cfg, media)
    except SampleRejected as e:  # e.g. no_audio_stream: a --video without sound under --use-audio-in-video
        print(f"error: our data pipeline rejects the conversation ({e})", file=sys.stderr)
        return 2
    errors = _token_id_errors(proc, omni)
    if errors:
        print("error: " + "; ".join(errors) + f" (template {proc.template.name!r}: is --template the one the model was "
              "trained with, e.g. qwen2_5_omni?)", file=sys.stderr)  # fmt: skip
        return 2
    ours_media = media_batch(proc, [(s, raw.media[s.part]) for s in sample.media])
    hf_model = _hf_thinker(hf_dir, hf_cfg)
    kw: dict = {}
    rows = []
    audio_spans = [s for s in sample.media if s.kind == "audio"]
    if audio_spans:
        features, mask = _hf_features(proc, sample, raw, model_cfg["audio_encoder"]["num_mel_bins"])
        hf_counts = hf_model.model.audio_tower._get_feat_extract_output_lengths(mask.sum(-1))[1].tolist()
        video_parts = {s.part for s in sample.media if s.kind == "video"}
        ours_counts = [s.length for s in audio_spans]  # a video's sound: the sum of its interleaved runs
        rows.append(("audio tokens", 0.0 if ours_counts == hf_counts else None,
                     f"per clip {ours_counts} planned from headers (HF {hf_counts})"
                     + "".join(f"; a video's sound track in runs {[n for _, n in s.ranges()]}" for s in audio_spans if s.part in video_parts)))  # fmt: skip
        lengths = ours_media["audio_lengths"]
        same = torch.equal(lengths, mask.sum(-1))
        diff = max((ours_media["audio_features"][i, :, :n] - features[i, :, :n]).abs().max().item()
                   for i, n in enumerate(lengths.tolist())) if same else None  # fmt: skip
        rows.append(("features", diff, f"{list(features.shape)} log-mel vs WhisperFeatureExtractor, frames {lengths.tolist()}"))
        if rows[0][1] is None or diff is None:
            return report(rows, args.atol)
        kw |= {"input_features": features, "feature_attention_mask": mask}
    kinds = [s.kind for s in sample.media if s.kind != "audio"]
    vision_spans = [s for s in sample.media if s.kind != "audio"]
    rows_per_item = np.cumsum([0] + [int(np.prod(s.grid_thw)) for s in vision_spans])
    for kind, pv, grid in (("image", "pixel_values", "image_grid_thw"), ("video", "pixel_values_videos", "video_grid_thw")):
        picked = [i for i, k in enumerate(kinds) if k == kind]
        if picked:
            kw[pv] = torch.cat([ours_media["pixel_values"][rows_per_item[i]:rows_per_item[i + 1]] for i in picked])
            kw[grid] = ours_media["grid_thw"][picked]
    seconds = [s.second_per_grid for s in vision_spans if s.kind == "video"]
    ids = torch.from_numpy(sample.input_ids.astype(np.int64))
    pos, _ = hf_model.model.get_rope_index(ids[None], kw.get("image_grid_thw"), kw.get("video_grid_thw"),
                                           torch.ones_like(ids[None]), args.use_audio_in_video, kw["feature_attention_mask"].sum(-1)
                                           if "feature_attention_mask" in kw else None,
                                           torch.tensor(seconds) if seconds else None)  # fmt: skip
    ours_pos = torch.from_numpy(sample.position_ids.astype(np.int64))
    wrong = int((ours_pos != pos[:, 0]).any(0).sum())
    rows.append(("positions", 0.0 if wrong == 0 else None,
                 f"[3, {ids.numel()}] TMRoPE planned offline vs get_rope_index" + (f": {wrong} differ" if wrong else "")))
    ours, _ = load_hf(hf_dir)
    ours.eval()
    batch = {"input_ids": ids, "position_ids": ours_pos, "cu_seqlens": torch.tensor([0, ids.numel()], dtype=torch.int32),
             **ours_media}  # fmt: skip
    with torch.no_grad():
        ref = hf_model(input_ids=ids[None], position_ids=pos, use_audio_in_video=args.use_audio_in_video, **kw).logits[0]
        got = ours.logits(batch)
    rows.append(("logits", (ref - got).abs().max().item(),
                 f"[{ref.shape[0]}, {ref.shape[1]}] fp32; {len(kinds)} image/video and {len(audio_spans)} audio "
                 "item(s); ours on our positions, transformers on its own"))  # fmt: skip
    return report(rows, args.atol)
