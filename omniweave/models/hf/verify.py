"""``omniweave hf verify HF_DIR [--image P …] [--video P …] [--audio P …] [--atol A] [--adapter ADAPTER_DIR]``

Builds the model twice from one Hugging Face directory — in transformers and in omniweave — and
runs the same conversation through both, printing max|Δ| for every stage:

    input_ids     ours (SampleProcessor, ``--template``) vs transformers' tokenizer rendering
                  the directory's chat template, each pad token repeated as Qwen2VLProcessor
                  does (grid / merge², grids from HF's image / video processor; a Qwen3-VL video
                  as ``<t seconds>`` + vision_start + pads + vision_end per temporal patch, t from
                  transformers' ``_calculate_timestamps`` of the frames its video processor
                  picked); without a chat template in the directory, our rendered text with HF's
                  pad counts
    frame_indices videos its video processor samples itself (``do_sample_frames``): its frames
    grid_thw      per media item
    pixel_values  images: ours (omniweave.data.media.vision) vs transformers' Qwen2VLImageProcessorPil,
                  when the directory has a preprocessor_config.json; videos: ours vs its
                  video processor (see Media below)
    position_ids  ours (data/text/rope_index.py) vs the model's get_rope_index
    logits        OmniModel.logits vs transformers' forward (fp32)

PaliGemma (``verify_paligemma.py``): two documents, each an image and a bidirectional prefix,
packed against each alone, logits with the prefix-LM mask (``prefix_lens`` vs ``token_type_ids``)
and without.

Audio-language models (an ``audio_config`` and no ``vision_config``: Qwen2-Audio) are checked by
``verify_audio.py`` (audio token counts, mel features, logits), the Qwen2.5-Omni thinker by
``verify_omni.py`` (also ``--use-audio-in-video``: the videos' own sound tracks as audio inputs;
any other model type refuses that flag, exit 2).

``--adapter ADAPTER_DIR`` (a PEFT LoRA adapter of HF_DIR, e.g. from ``hf export --adapter``): the
transformers side is peft's ``PeftModel`` over HF_DIR, ours the same base with the adapter loaded
(hf/peft_adapter.py); an adapter of another base model is refused, naming the tensors, and one
peft cannot load is one line, not peft's traceback.

It exits 1 when any difference exceeds ``--atol`` (ids and grids must be equal), 0 otherwise.

diffusers folders (a ``config.json`` with ``_class_name`` ``WanTransformer3DModel`` or
``AutoencoderKLWan``, or a Wan pipeline root with ``model_index.json``) are checked by
``verify_wan.py``: the Wan DiT's velocity and the VAE's latents and decoded frames against diffusers.

A text-only family (Qwen2, Llama-3, Qwen3, Qwen3-MoE, DeepSeek-V3, Gemma: no ``vision_config``) is checked on logits
alone: three documents of random tokens packed into one row through omniweave against each
document alone through transformers.

Media: the given files, or a random image and a random video when none are given. Videos go
through transformers' video processor (``AutoVideoProcessor`` of the directory's
video_preprocessor_config.json: ``Qwen2VLVideoProcessor``, or for Qwen3-VL
``Qwen3VLVideoProcessor``; frames decoded by its PyAV reader) and their frames, grids and pixels
are compared, where torchvision (which that processor needs) loads; otherwise, or without that
file, HF receives the pixel values our pipeline made and only positions and logits are compared
for videos (a Qwen3-VL model's videos then follow Qwen3VLVideoProcessor's rule on our side). An
exact difference (ids, frames, grids) stops before the models run. Without a
preprocessor_config.json, HF receives our pixel values for images too. Our side takes its
image and video settings from the directory's preprocessor_config.json and
video_preprocessor_config.json (an omniweave export writes both from its recipe). The tokenizer is
the directory's (tokenizer.json) or, for tiny test models without one, omniweave's demo tokenizer;
its pad-token ids must equal the config's ``image_token_id`` / ``video_token_id``.
"""

from __future__ import annotations

import argparse
import io
import re
import sys
from pathlib import Path

import numpy as np
import torch

from omniweave.data.text.hf_template import verify_template
from omniweave.errors import UserError
from omniweave.models.hf.loading import load_hf, read_hf_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", help="Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    parser.add_argument("--video", action="append", default=[], help="video file (repeatable)")
    parser.add_argument("--audio", action="append", default=[], help="audio file (repeatable; audio models)")
    parser.add_argument("--use-audio-in-video", action="store_true",
                        help="Qwen2.5-Omni: each --video's own sound track is an audio input too")
    parser.add_argument("--atol", type=float, default=1e-4, help="tolerance on max|Δ| (default 1e-4)")
    parser.add_argument("--prompt", default="Describe what you see.", help="user text after the media")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random media")
    parser.add_argument("--template", default="auto",
                        help="our chat template: a built-in name, hf, or auto (default: the directory's own "
                             "template when its tokenizer has one, i.e. hf; else chatml)")
    parser.add_argument("--adapter", default=None, metavar="ADAPTER_DIR",
                        help="a PEFT LoRA adapter of HF_DIR (hf export --adapter): transformers + peft's "
                             "PeftModel against omniweave with the adapter loaded (text and vision-language models)")


def random_media(seed: int) -> tuple[bytes, bytes]:
    """A random 84×112 PNG and a 6-frame 56×84 MPEG-4 clip at 4 fps."""
    from fractions import Fraction

    import av
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (84, 112, 3), dtype=np.uint8)).save(buf, format="PNG")
    vbuf = io.BytesIO()
    with av.open(vbuf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=Fraction(4))
        stream.width, stream.height, stream.pix_fmt = 84, 56, "yuv420p"
        for _ in range(6):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue(), vbuf.getvalue()


def _sample(args, hf_dir: Path, hf_cfg: dict, vision: dict | None = None, rope: str | None = None,
            default_template: str = "chatml", with_video: bool = True):
    """(SampleProcessor, RawSample, TokenizedSample) of the one conversation checked: the given
    media or a random image (and video); ``vision`` / ``rope`` override the Qwen-VL settings this
    reads off the directory (verify_internvl.py passes InternVL's)."""
    from omniweave.data.media.vision import video_settings_from_hf
    from omniweave.data.sample import Conversation, Message, RawSample
    from omniweave.data.text.tokenize import SampleProcessor

    images = [Path(p).read_bytes() for p in args.image]
    videos = [Path(p).read_bytes() for p in args.video]
    if not images and not videos:
        image, video = random_media(args.seed)
        images, videos = [image], ([video] if with_video else [])
    media = {f"img{i}.bin": b for i, b in enumerate(images)} | {f"vid{i}.bin": b for i, b in enumerate(videos)}
    conv = Conversation(
        id="verify",
        messages=[Message("user", "<image>" * len(images) + "<video>" * len(videos) + args.prompt),
                  Message("assistant", "A picture and a clip.")],  # fmt: skip
        images=[k for k in media if k.startswith("img")],
        videos=[k for k in media if k.startswith("vid")],
    )
    tokenizer = str(hf_dir) if (hf_dir / "tokenizer.json").exists() else "demo"
    template = verify_template(args.template, tokenizer, default_template)
    raw = RawSample(key="verify", conversation=conv, media=media)
    if vision is not None:
        proc = SampleProcessor({"tokenizer": tokenizer, "template": template, "max_len": 1 << 20, "rope": rope,
                                "vision": vision})  # fmt: skip
        return proc, raw, proc.tokenize(raw)
    qwen25 = hf_cfg["model_type"] == "qwen2_5_vl"
    rope = "mrope_qwen25" if qwen25 else "mrope_qwen3vl" if hf_cfg["model_type"] in QWEN3_VL else "mrope"
    vision = {}
    if (hf_dir / "preprocessor_config.json").exists():
        vision["preprocessor_config"] = str(hf_dir)
    else:  # patch sizes from the model itself (e.g. Qwen3-VL's 16)
        vc = hf_cfg.get("vision_config") or {}
        vision |= {k: vc[k] for k in ("patch_size", "temporal_patch_size") if k in vc}
        vision |= {"merge_size": vc["spatial_merge_size"]} if "spatial_merge_size" in vc else {}
    if hf_cfg["model_type"] in QWEN3_VL:  # Qwen3VLVideoProcessor's rule, also without its config file
        vision["frame_sampling"] = "qwen3_vl"
    if (hf_dir / "video_preprocessor_config.json").exists():
        try:
            vision |= video_settings_from_hf(hf_dir)
        except ValueError as e:
            raise UserError(str(e)) from None
    if qwen25:
        vision["tokens_per_second"] = float(hf_cfg.get("vision_config", {}).get("tokens_per_second", 2))
    proc = SampleProcessor({"tokenizer": tokenizer, "template": template, "max_len": 1 << 20,
                            "rope": rope, "vision": vision})  # fmt: skip
    return proc, raw, proc.tokenize(raw)


def _hf_image_inputs(hf_dir: Path, raw, sample):
    """pixel_values / image_grid_thw from transformers' image processor (None without config)."""
    if not (hf_dir / "preprocessor_config.json").exists():
        return None
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    spans = [s for s in sample.media if s.kind == "image"]
    if not spans:
        return None
    processor = Qwen2VLImageProcessorPil.from_pretrained(str(hf_dir))
    out = processor(images=[Image.open(io.BytesIO(raw.media[s.part])) for s in spans], return_tensors="pt")
    return torch.as_tensor(np.asarray(out["pixel_values"])), torch.as_tensor(np.asarray(out["image_grid_thw"]))


def _hf_video_inputs(hf_dir: Path, raw, sample) -> tuple[tuple | None, str]:
    """(pixel_values_videos, video_grid_thw, frames) from transformers' video processor of the
    directory (its video_preprocessor_config.json: ``Qwen2VLVideoProcessor``,
    ``Qwen3VLVideoProcessor``), frames decoded by transformers' PyAV reader, or None and why not.
    With ``do_sample_frames`` (an omniweave export, Qwen3-VL's released config) it picks the frames
    itself and ``frames`` holds, per video, the (indices, fps) it picked at; without, it is given
    the frames we picked, as Qwen's model cards give it qwen-vl-utils' frames, and ``frames`` is None."""
    import tempfile

    from omniweave.models.hf.torchvision_guard import torchvision_loads, why_not

    spans = [s for s in sample.media if s.kind == "video"]
    if not torchvision_loads():
        return None, f"HF given ours (its video processor needs torchvision; {why_not()})"
    if not (hf_dir / "video_preprocessor_config.json").exists():
        return None, "HF given ours (no video_preprocessor_config.json)"
    from transformers import AutoVideoProcessor
    from transformers.video_utils import load_video

    processor = AutoVideoProcessor.from_pretrained(str(hf_dir))
    pixels, grids, frames_at = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, span in enumerate(spans):
            path = Path(tmp) / f"video{i}"
            path.write_bytes(raw.media[span.part])
            frames, metadata = load_video(str(path), backend="pyav",
                                          sample_indices_fn=lambda metadata, **_: np.arange(metadata.total_num_frames))  # fmt: skip
            if processor.do_sample_frames:
                out = processor(videos=[frames], video_metadata=[metadata], return_metadata=True, return_tensors="pt")
                picked = out["video_metadata"][0]
                frames_at.append(([int(j) for j in picked.frames_indices], float(picked.fps)))
            else:  # our frames, without the padding repeats (the processor pads itself)
                out = processor(videos=[frames[list(dict.fromkeys(span.frame_indices))]], return_tensors="pt")
            pixels.append(out["pixel_values_videos"])
            grids.append(out["video_grid_thw"])
    how = "its own frames (do_sample_frames)" if processor.do_sample_frames else "our frames"
    return ((torch.cat(pixels), torch.cat(grids), frames_at if processor.do_sample_frames else None),
            f"videos: omniweave.data.media.vision vs {type(processor).__name__} on {how}")  # fmt: skip


def _hf_rendered_ids(hf_dir: Path, raw, proc, replacements: list[str],
                     markers: tuple[str, ...] | None = None) -> torch.Tensor | None:
    """[1, L] ids from transformers' tokenizer and the directory's chat template (content-part
    messages, as Qwen's own template expects), the i-th media item's marker — the text the family's
    processor replaces: ``markers``, by default the template's pad tokens — replaced by
    ``replacements[i]`` (see _hf_replacements); None when the directory has no chat template."""
    if not (hf_dir / "tokenizer.json").exists():
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    if not tokenizer.chat_template:
        return None
    messages = []
    for m in raw.conversation.messages:
        parts = re.split(r"(<image>|<video>)", m.content)
        messages.append({"role": m.role, "content": [{"type": p[1:-1]} if p in ("<image>", "<video>")
                                                     else {"type": "text", "text": p} for p in parts if p]})  # fmt: skip
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    text = replace_markers(text, markers or (proc.template.image_pad, proc.template.video_pad), replacements)
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])


def replace_markers(text: str, markers, replacements: list[str]) -> str:
    """``text`` with its i-th occurrence of any of ``markers`` replaced by ``replacements[i]``
    (occurrences past the replacements stay: they show as a DIFFER row)."""
    markers = set(markers)
    pieces = re.split("(" + "|".join(map(re.escape, sorted(markers))) + ")", text)
    replacements = iter(replacements)
    return "".join(next(replacements, p) if p in markers else p for p in pieces)


QWEN3_VL = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")  # videos written with timestamps (rope: mrope_qwen3vl)


def _hf_replacements(hf_cfg: dict, proc, raw, sample, counts: list[int], hf_frames: dict | None = None) -> list[str]:
    """What transformers' processor writes for each media item's pad token: the pad repeated
    ``counts[i]`` times; for a Qwen3-VL video, per temporal patch ``<t seconds>`` + vision_start +
    pads + vision_end, t from transformers' own ``Qwen3VLProcessor._calculate_timestamps`` of the
    frames its video processor picked (``hf_frames[i]``: indices, fps), else of ours."""
    out = []
    for i, (span, n) in enumerate(zip(sample.media, counts)):
        pad = proc.template.image_pad if span.kind == "image" else proc.template.video_pad
        if span.kind != "video" or hf_cfg["model_type"] not in QWEN3_VL:
            out.append(pad * n)
            continue
        from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

        indices, fps = (hf_frames or {}).get(i) or (span.frame_indices,
                                                     proc.plan_media("video", raw.media[span.part]).source_fps)  # fmt: skip
        times = Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, proc.vision.temporal_patch_size)
        per = n // len(times)
        out.append("".join(f"<{t:.1f} seconds><|vision_start|>{pad * per}<|vision_end|>" for t in times))
    return out


def ids_at_hf_counts(ids: torch.Tensor, media, counts: list[int]) -> torch.Tensor:
    """[1, L'] HF's ids where it is given our text: our ids with each item's run of pads repeated
    to HF's count ``counts[i]``; an item of several runs (a Qwen3-VL video) keeps ours (HF's own
    grid and frames are compared apart)."""
    pieces, cursor = [], 0
    for s, n in zip(media, counts):
        if s.pieces:
            pieces.append(ids[cursor : s.end])
        else:
            pieces += [ids[cursor : s.start], ids[s.start : s.start + 1].repeat(n)]
        cursor = s.end
    return torch.cat(pieces + [ids[cursor:]])[None]


TEXT_DOCS = (7, 23, 12)  # documents of the packed row a text-only model is checked on


def load_pair(args, hf_dir: Path, hf_cfg: dict):
    """(transformers model, omniweave model) of ``hf_dir`` in fp32 eval mode; with ``--adapter``
    both carry the PEFT adapter: peft's ``PeftModel`` and omniweave's LoRA (hf/peft_adapter.py)."""
    import transformers

    hf_model = getattr(transformers, hf_cfg["architectures"][0]).from_pretrained(
        str(hf_dir), dtype=torch.float32, attn_implementation="eager").eval()  # fmt: skip
    ours, _ = load_hf(hf_dir)
    if args.adapter:
        from omniweave.models.hf.peft_adapter import load_adapter

        load_adapter(ours, args.adapter)  # first: an adapter of another base fails here, with names
        try:
            from peft import PeftModel
        except ImportError:
            raise SystemExit("error: --adapter needs peft (pip install peft: the dev extra)") from None
        try:
            hf_model = PeftModel.from_pretrained(hf_model, str(args.adapter)).eval()
        except (KeyError, ValueError, RuntimeError) as e:  # what peft raises for an adapter it cannot apply
            first = (str(e).strip().splitlines() or [""])[0]
            raise UserError(f"{args.adapter}: peft cannot load this adapter over {hf_dir}: "
                            f"{type(e).__name__}: {first}") from None
    return hf_model, ours.eval()


def verify_text(args, hf_dir: Path, hf_cfg: dict) -> int:
    """A text-only family (no ``vision_config``): random token documents (``--seed``) packed into
    one row through omniweave vs each document alone through transformers."""

    if args.image or args.video:
        print(f"error: {hf_dir} is a text-only model ({hf_cfg['model_type']}); --image / --video need a "
              "vision-language model", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(args.seed)
    docs = [torch.randint(0, int(hf_cfg["vocab_size"]), (n,), generator=g) for n in TEXT_DOCS]
    hf_model, ours = load_pair(args, hf_dir, hf_cfg)
    batch = {"input_ids": torch.cat(docs), "position_ids": torch.cat([torch.arange(n) for n in TEXT_DOCS])[None],
             "cu_seqlens": torch.tensor([0, *np.cumsum(TEXT_DOCS)], dtype=torch.int32)}  # fmt: skip
    with torch.no_grad():
        ref = torch.cat([hf_model(input_ids=d[None], use_cache=False).logits[0] for d in docs])
        got = ours.logits(batch)
    rows = [("logits", (ref - got).abs().max().item(),
             f"[{ref.shape[0]}, {ref.shape[1]}] fp32; documents {list(TEXT_DOCS)} of random tokens packed "
             "in one row (omniweave) vs each alone (transformers)")]
    return _report(rows, args.atol)


def verify(args) -> int:
    from omniweave.models.hf.torchvision_guard import torchvision_loads
    from omniweave.models.hf.verify_wan import diffusers_class, verify_diffusers

    hf_dir = Path(args.hf_dir)
    if diffusers_class(hf_dir) is not None:  # a diffusers folder (Wan DiT / VAE) or pipeline root
        torchvision_loads()
        return verify_diffusers(args, hf_dir, _report)
    hf_cfg = read_hf_config(hf_dir)  # a wrong path is one error line, before any warning
    torchvision_loads()  # before transformers first looks for it: a broken one is hidden, with a warning
    omni = hf_cfg.get("model_type") in ("qwen2_5_omni_thinker", "qwen2_5_omni")
    if args.use_audio_in_video and not omni:
        print(f"error: --use-audio-in-video is Qwen2.5-Omni's; {hf_dir} is {hf_cfg.get('model_type')}", file=sys.stderr)
        return 2
    if args.adapter and (omni or ("audio_config" in hf_cfg and "vision_config" not in hf_cfg)):
        print(f"error: --adapter is supported for text and vision-language models; {hf_dir} is "
              f"{hf_cfg.get('model_type')}", file=sys.stderr)
        return 2
    if omni:
        from omniweave.models.hf.verify_omni import verify_omni

        return verify_omni(args, hf_dir, hf_cfg, _report)
    if hf_cfg.get("model_type") == "internvl" and not args.audio:
        from omniweave.models.hf.verify_internvl import verify_internvl

        return verify_internvl(args, hf_dir, hf_cfg, _report)
    if hf_cfg.get("model_type") == "paligemma" and not args.audio:
        from omniweave.models.hf.verify_paligemma import verify_paligemma

        return verify_paligemma(args, hf_dir, hf_cfg, _report)
    if hf_cfg.get("model_type") == "llava_onevision" and not args.audio:
        from omniweave.models.hf.verify_llava_onevision import verify_llava_onevision

        return verify_llava_onevision(args, hf_dir, hf_cfg, _report)
    if "audio_config" in hf_cfg and "vision_config" not in hf_cfg:
        from omniweave.models.hf.verify_audio import verify_audio

        return verify_audio(args, hf_dir, hf_cfg, _report)
    if args.audio:
        print(f"error: {hf_dir} ({hf_cfg['model_type']}) has no audio encoder; --audio needs an audio model", file=sys.stderr)
        return 2
    if "vision_config" not in hf_cfg:
        return verify_text(args, hf_dir, hf_cfg)
    proc, raw, sample = _sample(args, hf_dir, hf_cfg)
    for key, pad in (("image_token_id", proc.image_pad_id), ("video_token_id", proc.video_pad_id)):
        if hf_cfg.get(key) != pad:
            print(f"error: config {key}={hf_cfg.get(key)} but the tokenizer's pad token id is {pad}", file=sys.stderr)
            return 2
    merge = proc.vision.merge_size
    ours_pv = [torch.from_numpy(proc.process_media(s, raw.media[s.part])) for s in sample.media]
    ours_grid = torch.tensor([s.grid_thw for s in sample.media], dtype=torch.long)
    kinds = [s.kind for s in sample.media]
    img = [i for i, k in enumerate(kinds) if k == "image"]
    vid = [i for i, k in enumerate(kinds) if k == "video"]

    # ---- HF inputs: image processor for images where possible, our pixels otherwise
    hf_images = _hf_image_inputs(hf_dir, raw, sample)
    hf_kw: dict = {}
    if img:
        hf_kw["pixel_values"], hf_kw["image_grid_thw"] = hf_images or (torch.cat([ours_pv[i] for i in img]), ours_grid[img])
    hf_videos, video_note = _hf_video_inputs(hf_dir, raw, sample) if vid else (None, "")
    hf_frames = dict(zip(vid, hf_videos[2])) if hf_videos and hf_videos[2] is not None else {}
    if vid:
        hf_kw["pixel_values_videos"], hf_kw["video_grid_thw"] = hf_videos[:2] if hf_videos else (torch.cat([ours_pv[i] for i in vid]), ours_grid[vid])
        if hf_cfg["model_type"] == "qwen2_5_vl":
            hf_kw["second_per_grid_ts"] = torch.tensor([sample.media[i].second_per_grid for i in vid])
    hf_grids = {i: g for i, g in zip(img, hf_kw["image_grid_thw"].tolist())} if img else {}
    hf_grids |= {i: g for i, g in zip(vid, hf_kw["video_grid_thw"].tolist())} if vid else {}
    counts = [t * h * w // merge**2 for t, h, w in (hf_grids[i] for i in range(len(sample.media)))]
    ids = torch.from_numpy(sample.input_ids.astype(np.int64))
    hf_ids = _hf_rendered_ids(hf_dir, raw, proc, _hf_replacements(hf_cfg, proc, raw, sample, counts, hf_frames))
    how = (f"HF renders the directory's chat template, ours template {proc.template.name!r}" if hf_ids is not None
           else "HF given our text")
    if hf_ids is None:
        hf_ids = ids_at_hf_counts(ids, sample.media, counts)
    tt = torch.zeros_like(hf_ids)
    tt[hf_ids == proc.image_pad_id], tt[hf_ids == proc.video_pad_id] = 1, 2
    hf_kw["mm_token_type_ids"] = tt

    rows: list[tuple[str, float | None, str]] = []  # (what, max|Δ| or None for exact mismatch, note)
    same_ids = hf_ids.shape[1] == ids.numel() and torch.equal(hf_ids[0], ids)
    rows.append(("input_ids", 0.0 if same_ids else None, f"L={ids.numel()} (HF {hf_ids.shape[1]}); {how}"))
    if img:
        same_grid = torch.equal(hf_kw["image_grid_thw"], ours_grid[img])
        rows.append(("grid_thw", 0.0 if same_grid else None, f"images {ours_grid[img].tolist()}"))
        if hf_images is not None and same_grid:
            d = (hf_kw["pixel_values"] - torch.cat([ours_pv[i] for i in img])).abs().max().item()
            rows.append(("pixel_values", d, "images: omniweave.data.media.vision vs Qwen2VLImageProcessorPil"))
        elif hf_images is None:
            rows.append(("pixel_values", 0.0, "images: no preprocessor_config.json, HF given ours"))
    if vid and hf_videos is None:
        rows.append(("pixel_values", 0.0, f"videos: {video_note}"))
    elif vid:
        if hf_frames:  # the frames transformers picked, padded as its patchify pads them
            tp = proc.vision.temporal_patch_size
            picked = [idx + idx[-1:] * (-len(idx) % tp) for idx, _ in hf_frames.values()]
            same_frames = picked == [list(sample.media[i].frame_indices) for i in vid]
            rows.append(("frame_indices", 0.0 if same_frames else None,
                         f"videos: ours {[sample.media[i].frame_indices for i in vid]}, HF {picked}"))  # fmt: skip
        same_grid = torch.equal(hf_kw["video_grid_thw"], ours_grid[vid])
        rows.append(("grid_thw", 0.0 if same_grid else None, f"videos {ours_grid[vid].tolist()}"))
        if same_grid:
            d = (hf_kw["pixel_values_videos"] - torch.cat([ours_pv[i] for i in vid])).abs().max().item()
            rows.append(("pixel_values", d, video_note))
    if not same_ids or any(d is None for _, d, _ in rows):  # HF's inputs are not ours: no model run compares
        return _report(rows, args.atol)

    hf_model, ours = load_pair(args, hf_dir, hf_cfg)
    pos_ours = torch.from_numpy(sample.position_ids.astype(np.int64))
    rope_kw = {k: hf_kw[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in hf_kw}
    base = hf_model.get_base_model() if hasattr(hf_model, "get_base_model") else hf_model  # PeftModel: its base
    pos_hf, _ = base.model.get_rope_index(hf_ids, mm_token_type_ids=tt, **rope_kw)
    rows.append(("position_ids", (pos_hf[:, 0] - pos_ours).abs().max().item(), "M-RoPE [3, L]"))
    batch = {"input_ids": ids, "position_ids": pos_ours, "grid_thw": ours_grid,
             "pixel_values": torch.cat(ours_pv),  # span order
             "media_spans": torch.tensor([r for s in sample.media for r in s.ranges()], dtype=torch.long),
             "cu_seqlens": torch.tensor([0, ids.numel()], dtype=torch.int32)}  # fmt: skip
    with torch.no_grad():
        ref = hf_model(input_ids=hf_ids, **hf_kw).logits[0]
        got = ours.logits(batch)
    rows.append(("logits", (ref - got).abs().max().item(), f"[{ref.shape[0]}, {ref.shape[1]}] fp32"))
    return _report(rows, args.atol)


def _report(rows, atol: float) -> int:
    bad = [what for what, d, _ in rows if d is None or d > atol]
    for what, d, note in rows:
        value = "DIFFER" if d is None else f"{d:.3e}"
        print(f"{what:<13} max|Δ| = {value:<10} {note}")
    if bad:
        print(f"FAIL: {', '.join(bad)} above atol {atol:g}")
        return 1
    print(f"OK: all differences within atol {atol:g}")
    return 0


def run(args: argparse.Namespace) -> int:
    return verify(args)
