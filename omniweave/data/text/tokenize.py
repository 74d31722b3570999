"""RawSample -> TokenizedSample: template rendering, media planning, placeholder expansion,
M-RoPE positions and media-aware truncation. Metadata only: no pixel is ever decoded here.

    proc = SampleProcessor({"tokenizer": "demo", "template": "chatml", "max_len": 4096})
    sample = proc.tokenize(raw)                              # raises SampleRejected(reason)
    pixel_values = proc.process_media(sample.media[0], raw.media[sample.media[0].part])

Audio (``<audio>``, recipe section ``data.audio``) is planned from the header too: the clip's
encoder items (``audio.encoder_items``: Qwen2-Audio's 30 s chunks, or the whole clip for
Qwen2.5-Omni) each become one run of ``<|AUDIO|>`` pads, ``audio_item_tokens`` long; audio pads get
text positions (each M-RoPE row counts on through them, as for text).

With ``rope: mrope_omni`` and ``data.audio.use_audio_in_video``, each video's own sound track is an
audio item too (probed from the same bytes; a video without an audio stream is rejected,
``no_audio_stream``): its pad token becomes ``<|audio_bos|>``, the video's and the audio's pads
interleaved in ``seconds_per_chunk`` chunks (video first), then ``<|audio_eos|>`` -- between the
template's own vision bos / eos, as Qwen2.5-Omni's processor writes it. The video span and the audio
span (same ``part``) each hold one run of pads per chunk (``MediaSpan.pieces``).

Text is checked before it is tokenized. A special token typed in a message (``<|im_end|>``,
``<|image_pad|>`` …: the tokenizer would make it a control token) rejects the sample
(``special_token_in_text``) unless ``data.special_tokens_in_text: keep``. A sample whose text alone
needs more than ``max_len`` tokens (``len(text) // tokenizer.max_token_chars``, a lower bound) is
never tokenized whole: rejected ``too_long``, or under ``drop_turns`` cut to the messages that may fit
first, so a 30 MB row costs its bytes, not gigabytes of token offsets.

Truncation never cuts a media span. ``truncation: drop`` rejects an over-long sample
(reason ``too_long``, or ``vision_span_exceeds_max_len`` / ``audio_span_exceeds_max_len`` when
``max_len`` falls inside a media block); ``drop_turns`` drops trailing turns so the sample ends
with the last complete assistant turn that fits, keeping at least one, and sets ``truncated=True``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping

import numpy as np

from omniweave.config import DataSchema
from omniweave.data.media import vision as M
from omniweave.data.media.audio import AudioConfig, AudioPlan, audio_items, plan_audio, probe_audio
from omniweave.data.text.rope_index import ROPE_KINDS, chunk_bounds, position_ids
from omniweave.data.sample import (AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, MediaSpan, Message,
                                   RawSample, TokenizedSample)
from omniweave.data.text.hf_template import TemplateRejected
from omniweave.data.text.template import (IGNORE_INDEX, LOSS_ROLES, encode_conversation, load_template,
                                          token_loss_weights)
from omniweave.data.text.tokenizer import load_tokenizer
from omniweave.data.text.tools import ToolError, apply_tool_style

TRUNCATION_POLICIES = ("drop", "drop_turns")
SPECIAL_TOKEN_POLICIES = ("reject", "keep")  # data.special_tokens_in_text
# what a partial data config (tests, tools) falls back to: the recipe schema's defaults, the one source
DATA_DEFAULTS = {k: getattr(DataSchema, k) for k in ("tokenizer", "template", "max_len", "truncation", "rope",
                                                     "special_tokens_in_text", "mask_history", "train_on_prompt")}


class SampleRejected(Exception):
    """A sample that cannot be used; ``reason`` is the tag counted in reports."""

    def __init__(self, reason: str, message: str = ""):
        super().__init__(f"{reason}: {message}" if message else reason)
        self.reason = reason


def _plain(cfg) -> dict:
    """dict from a dict or an OmegaConf DictConfig."""
    if cfg is None:
        return {}
    if hasattr(cfg, "_metadata"):  # DictConfig, without importing omegaconf eagerly
        from omegaconf import OmegaConf

        return OmegaConf.to_container(cfg, resolve=True)
    return dict(cfg)


MEDIA_KINDS = ("image", "video", "audio")
PLACEHOLDERS = {"image": IMAGE_PLACEHOLDER, "video": VIDEO_PLACEHOLDER, "audio": AUDIO_PLACEHOLDER}


def overflow_reason(spans: list[MediaSpan], max_len: int) -> str:
    """Why a sample longer than max_len cannot simply be cut there."""
    cut = next((s for s in spans if s.start <= max_len <= s.end), None)
    if cut is None:
        return "too_long"
    return "audio_span_exceeds_max_len" if cut.kind == "audio" else "vision_span_exceeds_max_len"


def weight_runs(labels: np.ndarray, weights: np.ndarray) -> list[tuple[int, int, float]] | None:
    """[start, end) runs of loss tokens (labels != -100) whose weight is not 1, with the weight;
    None when there are none."""
    odd = (labels != IGNORE_INDEX) & (weights != 1.0)
    runs, k, n = [], 0, len(labels)
    while k < n:
        if not odd[k]:
            k += 1
            continue
        end = k + 1
        while end < n and odd[end] and weights[end] == weights[k]:
            end += 1
        runs.append((k, end, float(weights[k])))
        k = end
    return runs or None


class SampleProcessor:
    def __init__(self, data_cfg: Mapping | None = None):
        cfg = {**DATA_DEFAULTS, **_plain(data_cfg)}
        self.tokenizer = load_tokenizer(cfg["tokenizer"])
        self.template = load_template(cfg["template"], tokenizer=cfg["tokenizer"])
        self.vision = M.VisionConfig.from_mapping(_plain(cfg.get("vision")))
        self.audio = AudioConfig.from_mapping(_plain(cfg.get("audio")))
        self.max_len = int(cfg["max_len"])
        self.truncation = str(cfg["truncation"])
        self.rope = str(cfg["rope"])
        self.special_tokens_in_text = str(cfg["special_tokens_in_text"])
        self.mask_history, self.train_on_prompt = bool(cfg["mask_history"]), bool(cfg["train_on_prompt"])
        from omniweave.data.packing.vla import VLASettings

        self.vla = VLASettings.from_mapping(_plain(cfg.get("vla")))  # data.vla: a robot frame's prompt (packing/vla.py)
        from omniweave.diffusion.data import DiffusionSettings

        diffusion = _plain(cfg.get("diffusion"))  # data.diffusion: a clip's frames and size (diffusion/data.py)
        self.diffusion = DiffusionSettings.from_mapping(diffusion)
        self.diffusion_codecs = diffusion.get("codecs")  # what made the latents and text states
        if self.truncation not in TRUNCATION_POLICIES:
            raise ValueError(f"data.truncation={self.truncation!r}; choose one of {TRUNCATION_POLICIES}")
        if self.special_tokens_in_text not in SPECIAL_TOKEN_POLICIES:
            raise ValueError(f"data.special_tokens_in_text={self.special_tokens_in_text!r}; "
                             f"choose one of {SPECIAL_TOKEN_POLICIES}")
        specials = self.tokenizer.special_tokens if self.special_tokens_in_text == "reject" else ()
        # a media tag the tokenizer also has as a token (InternVL's <video>, LLaVA's <image>) is our placeholder
        specials = [t for t in specials if t not in PLACEHOLDERS.values()]
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        if self.rope not in ROPE_KINDS:
            raise ValueError(f"data.rope={self.rope!r}; choose one of {ROPE_KINDS}")
        if self.max_len < 1:
            raise ValueError(f"data.max_len must be positive, got {self.max_len}")
        self.image_pad_id = self.tokenizer.token_id(self.template.image_pad)
        # a tokenizer without the video pad still serves images (InternVL's hold no <video> token: its
        # processor replaces the text "<video>"); a video is then a counted reject, no_video_token
        has_video = self.tokenizer.has_token(self.template.video_pad)
        self.video_pad_id = self.tokenizer.token_id(self.template.video_pad) if has_video else None
        # a tokenizer without audio tokens still serves image / video / text data
        has_audio = self.tokenizer.has_token(self.template.audio_pad)
        self.audio_pad_id = self.tokenizer.token_id(self.template.audio_pad) if has_audio else None
        if self.rope == "mrope_qwen3vl":  # video timestamps: each temporal patch in its own vision block
            self.vision_start_id = self.tokenizer.token_id("<|vision_start|>")
            self.vision_end_id = self.tokenizer.token_id("<|vision_end|>")
        if self.audio.use_audio_in_video:
            if self.rope != "mrope_omni":
                raise ValueError("data.audio.use_audio_in_video needs rope: mrope_omni (Qwen2.5-Omni's positions)")
            bos, eos = self.template.audio.split(self.template.audio_pad)  # <|audio_bos|>, <|audio_eos|>
            self.audio_bos_ids, self.audio_eos_ids = self.tokenizer.encode(bos), self.tokenizer.encode(eos)
            if len(self.audio_bos_ids) != 1 or len(self.audio_eos_ids) != 1 or self.audio_pad_id is None:
                raise ValueError(f"use_audio_in_video: template audio {self.template.audio!r} must be bos + pad + eos tokens")

    # ------------------------------------------------------------------ identity

    def fingerprint(self) -> dict:
        """What decides the token stream; a pack built with another fingerprint is not ours."""
        from omniweave.data.packing.vla import VLASettings
        from omniweave.diffusion.data import DiffusionSettings

        return {
            "tokenizer_sha256": self.tokenizer.sha256(),
            "template": self.template.spec(),
            "vision": self.vision.spec(),
            "audio": self.audio.spec(),
            "max_len": self.max_len,
            "rope": self.rope,
            "truncation": self.truncation,
            "special_tokens_in_text": self.special_tokens_in_text,
            "loss": {"mask_history": self.mask_history, "train_on_prompt": self.train_on_prompt},
            # data.vla only where it differs from the defaults: packs of other kinds never depend on it,
            # and packs built before it existed keep matching
            **({"vla": self.vla.spec()} if self.vla != VLASettings() else {}),
            # data.diffusion likewise, with the codecs of a diffusion recipe (diffusion/data.py: with_codecs)
            **({"diffusion": {**self.diffusion.spec(), "codecs": self.diffusion_codecs}}
               if self.diffusion != DiffusionSettings() or self.diffusion_codecs else {}),
        }

    # ------------------------------------------------------------------ metadata-only path

    def plan_media(self, kind: str, data: bytes, images: int = 1) -> M.MediaPlan | AudioPlan | VideoWithAudio:
        """Grid / resize / frames of one image or video (with its sound track's plan under
        ``use_audio_in_video``), or the encoder items of a clip, from its header. ``images``: how
        many images the sample's text holds (``vision.plans_by_image_count``: LLaVA-OneVision tiles
        a lone image, and gives each of several one tile)."""
        if kind == "image":
            return M.plan_image(M.probe_image(data), self.vision, images)
        if kind == "audio":
            return plan_audio(probe_audio(data), self.audio)
        video = M.plan_video(M.probe_video(data), self.vision)
        if self.audio.use_audio_in_video:  # no audio stream: MediaError("no_audio_stream")
            return VideoWithAudio(video, plan_audio(probe_audio(data), self.audio))
        return video

    def tokenize(self, raw: RawSample) -> TokenizedSample:
        conv = raw.conversation
        messages, tools = self.messages(conv), self.template_tools(conv)
        plans = self._plan_all(raw)
        may_fit = self._messages_that_may_fit(messages)
        if may_fit < len(messages):  # certainly over max_len: never tokenized whole
            if self.truncation == "drop" or not any(m.role in LOSS_ROLES for m in messages[:may_fit]):
                raise SampleRejected("too_long", f"its text alone needs more than {self.max_len} tokens")
            return self._drop_turns(raw, messages, plans, may_fit, "too_long", tools)
        sample = self._encode(conv.id, messages, plans, tools=tools)
        if not (sample.labels != IGNORE_INDEX).any():
            raise SampleRejected("no_assistant_turn", "nothing carries loss")
        if len(sample) <= self.max_len:
            return sample
        if self.truncation == "drop":
            raise SampleRejected(overflow_reason(sample.media, self.max_len), f"{len(sample)} > {self.max_len}")
        return self._drop_turns(raw, messages, plans, len(messages) - 1, overflow_reason(sample.media, self.max_len), tools)

    def messages(self, conv) -> list[Message]:
        """The turns as the template renders them: the user's text checked (``check_text``), then its
        tools and tool calls in the template's style (data/text/tools.py; a template that renders tools
        itself, ``hf``, gets them as they are)."""
        self.check_text(conv.messages)
        if self.template.renders_tools:
            return conv.messages
        try:
            return apply_tool_style(self.template.tool_style, self.template.default_system, conv.messages,
                                    conv.meta.get("tools"))
        except ToolError as e:
            raise SampleRejected(e.reason, str(e)) from None

    def template_tools(self, conv) -> list[dict] | None:
        """The tool definitions the template renders itself (``renders_tools``); None for the others,
        whose messages carry them already (``messages``)."""
        return conv.meta.get("tools") if self.template.renders_tools else None

    def check_text(self, messages: list[Message]) -> None:
        """Reject typed special tokens (``data.special_tokens_in_text: reject``)."""
        if self._special_re is None:
            return
        for m in messages:
            found = self._special_re.search(m.content)
            if found:
                raise SampleRejected("special_token_in_text", f"{m.role} text holds {found.group()!r} (a control "
                                     "token once tokenized; data.special_tokens_in_text=keep keeps it)")

    def _messages_that_may_fit(self, messages: list[Message]) -> int:
        """How many leading messages may fit max_len, judged by a lower bound on their text's tokens
        (no tokenizing): all of them unless the text alone is certainly too long."""
        chars = 0
        for k, m in enumerate(messages):
            chars += len(m.content)
            if chars // self.tokenizer.max_token_chars > self.max_len:
                return k
        return len(messages)

    def tokenize_prompt(self, raw: RawSample, bounded: bool = False) -> TokenizedSample:
        """A generation prompt: the conversation without its trailing assistant turn(s), plus the
        assistant header. Labels are all -100; used by evaluation (greedy decoding). ``bounded``: a
        prompt whose text alone needs more than max_len tokens is rejected (``too_long``) untokenized."""
        conv = raw.conversation
        messages = list(self.messages(conv))
        while messages and messages[-1].role in LOSS_ROLES:
            messages.pop()
        if not messages:
            raise SampleRejected("empty_conversation", "no prompt left once the assistant turns are removed")
        if bounded and self._messages_that_may_fit(messages) < len(messages):
            raise SampleRejected("too_long", f"its prompt's text alone needs more than {self.max_len} tokens")
        sample = self._encode(conv.id, messages, self._plan_all(raw), add_generation_prompt=True,
                              tools=self.template_tools(conv))
        sample.labels[:] = IGNORE_INDEX
        sample.loss_weights = None  # a prompt carries no loss, so no weights either
        return sample

    def _plan_all(self, raw: RawSample) -> dict:
        """{kind: [(part, plan)]} of every media item of the sample, images planned for the
        conversation's image count (``_drop_turns`` re-plans them for the count it keeps)."""
        conv = raw.conversation
        return {kind: self._plan_parts(raw, kind, parts, len(conv.images))
                for kind, parts in (("image", conv.images), ("video", conv.videos), ("audio", conv.audios))}

    def _plan_parts(self, raw: RawSample, kind: str, parts: list[str], images: int) -> list:
        plans = []
        for part in parts:
            if part not in raw.media:
                raise SampleRejected("missing_media", f"{kind} part {part!r} not in the sample")
            try:
                plans.append((part, self.plan_media(kind, raw.media[part], images)))
            except M.MediaError as e:
                raise SampleRejected(e.reason, f"{part}: {e}") from e
        return plans

    def _encode(self, sample_id: str, messages: list[Message], plans: dict, add_generation_prompt: bool = False,
                tools: list[dict] | None = None) -> TokenizedSample:
        """Render, tokenize, and expand each media pad token to the item's token count."""
        try:
            ids, labels, rendered, offsets = encode_conversation(self.template, self.tokenizer, messages,
                                                           add_generation_prompt, self.mask_history,
                                                           self.train_on_prompt, tools)
        except TemplateRejected as e:
            raise SampleRejected(e.reason, str(e)) from None
        kinds = rendered.media_kinds
        if any(kinds.count(k) != len(plans[k]) for k in MEDIA_KINDS):
            raise SampleRejected(
                "media_count_mismatch",
                "/".join(f"{kinds.count(k)} {PLACEHOLDERS[k]}" for k in MEDIA_KINDS) + " placeholders for "
                + "/".join(f"{len(plans[k])} {k}s" for k in MEDIA_KINDS),
            )
        if "audio" in kinds and self.audio_pad_id is None:
            raise SampleRejected("no_audio_token", f"the tokenizer has no {self.template.audio_pad!r} token")
        if "video" in kinds and self.video_pad_id is None:
            raise SampleRejected("no_video_token", f"the tokenizer has no {self.template.video_pad!r} token")
        pad_ids = {self.image_pad_id: "image", self.video_pad_id: "video", self.audio_pad_id: "audio"}
        pad_at = np.flatnonzero(np.isin(ids, [i for i in pad_ids if i is not None]))
        pad_kinds = [pad_ids[int(ids[i])] for i in pad_at]
        shared = self.image_pad_id == self.video_pad_id  # one pad marks images and videos (InternVL): the text orders them
        if [k if not shared or k == "audio" else "vision" for k in pad_kinds] != \
                [k if not shared or k == "audio" else "vision" for k in kinds]:  # e.g. a literal <|image_pad|> typed in the text
            raise SampleRejected("placeholder_mismatch", f"pad tokens {pad_kinds} != placeholders {kinds}")
        next_item = {kind: iter(plans[kind]) for kind in MEDIA_KINDS}
        ordered = [next(next_item[k]) for k in kinds]  # (part, plan) in reading order
        weights = token_loss_weights(offsets, rendered)  # None: every loss token weighs 1
        id_parts, label_parts, weight_parts, spans = [], [], [], []
        cursor, out_len = 0, 0  # next original token to copy; tokens written so far
        for i, (part, plan) in zip(pad_at.tolist(), ordered):
            id_parts.append(ids[cursor:i])
            label_parts.append(labels[cursor:i])
            weight_parts.append(weights[cursor:i] if weights is not None else None)
            out_len += i - cursor
            if isinstance(plan, VideoWithAudio):
                tokens, video_runs, audio_runs = self._video_with_audio_tokens(plan, int(ids[i]))
                spans += [_span(plan.video, part, [(out_len + start, n) for start, n in video_runs]),
                          _span(plan.audio, part, [(out_len + start, n) for start, n in audio_runs])]
            else:
                tokens, runs = self._media_tokens(plan, int(ids[i]))
                spans.append(_span(plan, part, [(out_len + start, n) for start, n in runs]))
            id_parts.append(tokens.astype(ids.dtype))
            label_parts.append(np.full(len(tokens), IGNORE_INDEX, dtype=labels.dtype))  # media tokens carry no loss
            weight_parts.append(np.ones(len(tokens), dtype=np.float32) if weights is not None else None)
            out_len += len(tokens)
            cursor = i + 1
        input_ids = np.concatenate(id_parts + [ids[cursor:]])
        label_ids = np.concatenate(label_parts + [labels[cursor:]])
        pos = position_ids(self.rope, len(input_ids), spans, self.vision.merge_size, self.vision.tokens_per_second,
                           self.vision.position_id_per_seconds, self.audio.seconds_per_chunk)
        runs = None
        if weights is not None:
            runs = weight_runs(label_ids, np.concatenate(weight_parts + [weights[cursor:]]))
        return TokenizedSample(id=sample_id, input_ids=input_ids, labels=label_ids, position_ids=pos, media=spans,
                               loss_weights=runs)

    def _media_tokens(self, plan: M.MediaPlan | AudioPlan, pad_id: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """What one media pad token becomes, and the (start, length) runs of pads in it: the pad
        repeated once per feature (audio: one run per encoder item, back to back); with ``rope:
        mrope_qwen3vl`` a video is, per temporal patch, ``<{t:.1f} seconds>`` + vision_start + pads +
        vision_end (transformers' Qwen3VLProcessor, which keeps the template's own vision_start /
        vision_end around the whole video); under ``tiling: internvl`` a video is its frames
        (``_tiled_video_tokens``)."""
        if isinstance(plan, AudioPlan):
            starts = np.cumsum([0, *plan.item_tokens])[:-1].tolist()
            return np.full(sum(plan.item_tokens), pad_id, dtype=np.int64), list(zip(starts, plan.item_tokens))
        if plan.kind == "video" and self.vision.tiling == "internvl":
            return self._tiled_video_tokens(plan)
        n = plan.num_tokens(self.vision.merge_size)
        if self.rope != "mrope_qwen3vl" or plan.kind != "video":
            return np.full(n, pad_id, dtype=np.int64), [(0, n)]
        per_patch = n // plan.grid_thw[0]
        seq, runs = [], []
        for sec in M.video_timestamps(plan.frame_indices, plan.source_fps, self.vision.temporal_patch_size):
            seq += self.tokenizer.encode(f"<{sec:.1f} seconds>") + [self.vision_start_id]
            runs.append((len(seq), per_patch))
            seq += [pad_id] * per_patch + [self.vision_end_id]
        return np.asarray(seq, dtype=np.int64), runs

    def _tiled_video_tokens(self, plan: M.MediaPlan) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """InternVL's frames, what ``InternVLProcessor.replace_video_token`` puts where the template
        wrote the video's marker (``<video>``): ``"\\n".join(f"Frame{i+1}: <img>" + pads + "</img>")``,
        one run of pads per frame. The pads are the image pad (``<IMG_CONTEXT>``: the model reads
        frames as tiles), so the marker stays the only token that tells a video's place. The text is
        tokenized on its own: equal to tokenizing the whole conversation where the video follows a
        newline or a special token (the pre-tokenizer splits there), as transformers' chat template
        writes a video first in its turn or after another media item."""
        per_frame = plan.num_tokens(self.vision.merge_size) // plan.grid_thw[0]
        start, end = self.tokenizer.token_id("<img>"), self.tokenizer.token_id("</img>")
        seq, runs = [], []
        for i in range(plan.grid_thw[0]):
            seq += self.tokenizer.encode(("\n" if i else "") + f"Frame{i + 1}: ") + [start]
            runs.append((len(seq), per_frame))
            seq += [self.image_pad_id] * per_frame + [end]
        return np.asarray(seq, dtype=np.int64), runs

    def _video_with_audio_tokens(self, plan: "VideoWithAudio", video_pad_id: int):
        """``<|audio_bos|>`` + video and audio pads in alternating chunks + ``<|audio_eos|>``, and the
        (start, length) runs of each: Qwen2.5-Omni's ``replace_video_with_audio_token``, whose chunks
        cut the video's temporal ids ``i · second_per_grid · position_id_per_seconds`` (float64,
        not truncated) and the audio's token indices at multiples of ``position_id_per_seconds ·
        seconds_per_chunk``."""
        video, sound = plan.video, plan.audio
        t, h, w = video.grid_thw
        per_patch = h * w // self.vision.merge_size**2
        pps = self.vision.position_id_per_seconds
        video_ids = np.repeat(np.arange(t) * video.second_per_grid * pps, per_patch)
        per_chunk = int(pps * self.audio.seconds_per_chunk)
        video_chunks = chunk_bounds(video_ids, per_chunk)
        audio_chunks = chunk_bounds(np.arange(sum(sound.item_tokens)), per_chunk)
        seq, video_runs, audio_runs = list(self.audio_bos_ids), [], []
        streams = ((video_chunks, video_runs, video_pad_id), (audio_chunks, audio_runs, self.audio_pad_id))
        for j in range(max(len(video_chunks), len(audio_chunks))):
            for chunks, runs, pad in streams:  # video chunk j, then audio chunk j
                if j < len(chunks):
                    runs.append((len(seq), chunks[j][1] - chunks[j][0]))
                    seq += [pad] * runs[-1][1]
        seq += self.audio_eos_ids
        return np.asarray(seq, dtype=np.int64), video_runs, audio_runs

    def _drop_turns(self, raw: RawSample, messages: list[Message], plans: dict, upto: int, reason: str,
                    tools: list[dict] | None = None):
        """Longest prefix of ``messages[:upto]`` ending in an assistant turn that fits max_len (≥ 1
        assistant turn); else rejected with ``reason``. The prefix keeps the first images; where an
        image's plan depends on the image count (``vision.plans_by_image_count``) they are planned
        again for the count kept -- the text the model then sees, from which transformers' processor
        decides too (LLaVA-OneVision: two images, one dropped, leave one image tiled anyres)."""
        ends = [k + 1 for k, m in enumerate(messages[:upto]) if m.role in LOSS_ROLES]
        replanned = {}  # image count -> the first images planned for it
        for k in reversed(ends):
            kept = messages[:k]
            counts = {kind: sum(m.content.count(PLACEHOLDERS[kind]) for m in kept) for kind in MEDIA_KINDS}
            kept_plans = {kind: plans[kind][:n] for kind, n in counts.items()}
            n = counts["image"]
            if self.vision.plans_by_image_count and n < len(plans["image"]):
                if n not in replanned:
                    replanned[n] = self._plan_parts(raw, "image", raw.conversation.images[:n], n)
                kept_plans["image"] = replanned[n]
            sample = self._encode(raw.conversation.id, kept, kept_plans, tools=tools)
            if len(sample) <= self.max_len:
                return dataclasses.replace(sample, truncated=True)
        raise SampleRejected(reason, "no assistant turn fits max_len")

    # ------------------------------------------------------------------ full processing

    def process_audio(self, span: MediaSpan, data: bytes) -> list[np.ndarray]:
        """Decode one clip (16 kHz mono; a video's sound track under ``use_audio_in_video``) and cut
        it into the encoder items its span was planned with (their tokens fill the span's runs in
        order: one run per item, or, for a video's sound, one item over several runs)."""
        return audio_items(data, self.audio, span.num_samples)

    def process_media(self, span: MediaSpan, data: bytes) -> np.ndarray:
        """Decode + resize + patchify one media item: float32 [t*h*w, 3*tp*p*p] matching span.grid_thw."""
        if span.kind == "image":  # the packed plan: LLaVA-OneVision's grid says which path (anyres_plan)
            planned = M.MediaPlan("image", tuple(span.grid_thw), tuple(span.resized_hw))
            pixel_values, plan = M.process_image(data, self.vision, plan=planned)
        else:
            planned = M.MediaPlan("video", tuple(span.grid_thw), tuple(span.resized_hw),
                                  tuple(span.frame_indices), span.second_per_grid)
            pixel_values, plan = M.process_video(data, self.vision, plan=planned)
        t, h, w = span.grid_thw
        if tuple(plan.grid_thw) != tuple(span.grid_thw) or pixel_values.shape[0] != t * h * w:  # bytes changed since pack
            raise M.MediaError(
                "media_changed",
                f"{span.part}: processed grid {plan.grid_thw} ({pixel_values.shape[0]} patches) != planned {span.grid_thw}",
            )
        return pixel_values


@dataclasses.dataclass(frozen=True)
class VideoWithAudio:
    """A video and its own sound track (``use_audio_in_video``): one placeholder, two media items."""

    video: M.MediaPlan
    audio: AudioPlan


def _span(plan: M.MediaPlan | AudioPlan, part: str, runs: list[tuple[int, int]]) -> MediaSpan:
    """The MediaSpan of one planned item whose pad tokens sit in ``runs`` (absolute positions)."""
    common = dict(part=part, start=runs[0][0], length=sum(n for _, n in runs), pieces=runs if len(runs) > 1 else None)
    if isinstance(plan, AudioPlan):  # no patch grid: zeros
        return MediaSpan(kind="audio", grid_thw=(0, 0, 0), resized_hw=(0, 0), num_samples=plan.num_samples, **common)
    return MediaSpan(
        kind=plan.kind, grid_thw=tuple(plan.grid_thw), resized_hw=tuple(plan.resized_hw),
        frame_indices=list(plan.frame_indices) if plan.frame_indices is not None else None,
        second_per_grid=plan.second_per_grid, **common,
    )
