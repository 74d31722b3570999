"""Chat templates: render a Conversation to text, token ids and assistant-only loss labels.

A template is a handful of format strings, one per role, each holding ``{content}``::

    chatml     <|im_start|>user\\n{content}<|im_end|>\\n      (Qwen2 / Qwen2-VL / Qwen2.5-VL)
    llava_onevision  ChatML, no system prompt, each turn's media first: <image>\\n… <video>\\n… text
    qwen2_5_omni  ChatML with Qwen2.5-Omni's system prompt and media tokens:
               <|vision_bos|><|IMAGE|><|vision_eos|>, <|vision_bos|><|VIDEO|><|vision_eos|>,
               <|audio_bos|><|AUDIO|><|audio_eos|> (as its processor and chat template write them)
    llama3     <|start_header_id|>user<|end_header_id|>\\n\\n{content}<|eot_id|>
    plain      {content}\\n

Loss rule: in an assistant (or function-call) turn, the reply and everything after it in the
format string carry loss; the role header before ``{content}`` does not. For ChatML that is
``reply<|im_end|>\\n``: the trailing newline carries loss, as in LLaMA-Factory's ``qwen2_vl``
template and Qwen2.5-VL's own fine-tuning script (both label ``<|im_end|>\\n``). Media blocks never
carry loss. Every assistant turn of a multi-turn conversation is labelled.

Media placeholders ``<image>`` / ``<video>`` / ``<audio>`` become ``image`` / ``video`` / ``audio``
(by default ``<|vision_start|><|image_pad|><|vision_end|>`` and, as Qwen2-Audio / Qwen2.5-Omni write
it, ``<|audio_bos|><|AUDIO|><|audio_eos|>``); tokenize.py later repeats the pad token once per
media token. Custom templates: a YAML file with any of the ChatTemplate fields, e.g.::

    name: my_chatml
    system: "<|im_start|>system\\n{content}<|im_end|>\\n"
    user: "<|im_start|>user\\n{content}<|im_end|>\\n"
    assistant: "<|im_start|>assistant\\n{content}<|im_end|>\\n"
    default_system: null
    stop_tokens: ["<|im_end|>"]

``jinja_export.hf_chat_template(template)`` writes any template as a Hugging Face Jinja chat
template (an export's ``chat_template.jinja``) that renders the same text.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from omniweave.data.sample import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, ROLES, VIDEO_PLACEHOLDER, Message
from omniweave.data.text.tokenizer import Tokenizer
from omniweave.data.text.tools import TOOL_STYLES

IGNORE_INDEX = -100
LOSS_ROLES = ("assistant", "function")
_PLACEHOLDER_KINDS = {IMAGE_PLACEHOLDER: "image", VIDEO_PLACEHOLDER: "video", AUDIO_PLACEHOLDER: "audio"}
_PLACEHOLDER_RE = re.compile("(" + "|".join(map(re.escape, _PLACEHOLDER_KINDS)) + ")")


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    system: str
    user: str
    assistant: str
    observation: str
    function: str
    default_system: str | None = None  # inserted when the conversation has no system turn
    bos: str = ""  # prepended once, no loss
    image: str = "<|vision_start|><|image_pad|><|vision_end|>"
    video: str = "<|vision_start|><|video_pad|><|vision_end|>"
    image_pad: str = "<|image_pad|>"  # the token repeated once per image token
    video_pad: str = "<|video_pad|>"
    audio: str = "<|audio_bos|><|AUDIO|><|audio_eos|>"  # Qwen2.5-Omni; "{index}" = the clip's number (from 1)
    audio_pad: str = "<|AUDIO|>"  # repeated once per audio token
    stop_tokens: tuple[str, ...] = ()
    tool_style: str | None = None  # how tools and tool calls render (data/text/tools.py); None: this template has none
    # fields added later: left out of spec() at their defaults, so packs built before them stay valid
    generation_prompt: str | None = None  # what add_generation_prompt appends; None: the assistant header
    think_style: str | None = None  # "qwen3" | "drop": how <think> blocks render (apply_think_style)
    trim_content: bool | None = None  # True: each turn's text stripped of surrounding whitespace (Llama 3)
    # what the family's HF chat template writes for an image when its processor frames the pads itself
    # (InternVL: "<IMG_CONTEXT>\n", InternVLProcessor adds <img> … </img>); None: ``image`` as it is
    processor_image: str | None = None
    processor_video: str | None = None  # the same for a video (InternVL: "<video>\n", replaced by its frames)
    # True: a turn's media render first, its images then its videos then its audio, then its text with
    # the placeholders taken out (LLaVA-OneVision's released template renders content parts so)
    media_first: bool | None = None

    def __post_init__(self):
        for role in ROLES:
            fmt = getattr(self, role)
            if fmt.count("{content}") != 1:
                raise ValueError(f"template {self.name!r}: {role} format must hold '{{content}}' once: {fmt!r}")
        if self.think_style is not None and self.think_style not in THINK_STYLES:
            raise ValueError(f"template {self.name!r}: think_style {self.think_style!r}; choose one of {THINK_STYLES}")
        if self.tool_style is not None and self.tool_style not in TOOL_STYLES:
            raise ValueError(f"template {self.name!r}: tool_style {self.tool_style!r}; choose one of {TOOL_STYLES}")
        if "{index}" in self.image + self.video:
            raise ValueError(f"template {self.name!r}: only the audio format may number its items ({{index}})")
        if self.image_pad not in self.image or self.video_pad not in self.video or self.audio_pad not in self.audio:
            raise ValueError(f"template {self.name!r}: image/video/audio formats must contain their pad token")

    def spec(self) -> dict:
        """JSON-serialisable description (for fingerprints)."""
        d = dataclasses.asdict(self)
        d["stop_tokens"] = list(self.stop_tokens)
        for key in _LATER_FIELDS:
            if d[key] is None:
                del d[key]
        return d

    renders_tools = False  # its tool text is in the messages already (tools.apply_tool_style); HFChatTemplate's is not

    def render(self, messages: list[Message], add_generation_prompt: bool = False, mask_history: bool = False,
               train_on_prompt: bool = False, tools: list[dict] | None = None) -> "Rendered":
        """:func:`render` (``tools`` are already in the messages)."""
        return render(self, messages, add_generation_prompt, mask_history, train_on_prompt)

    def generation_header(self) -> str:
        """What ``add_generation_prompt`` appends: the assistant's header unless the template says otherwise."""
        return self.assistant.split("{content}")[0] if self.generation_prompt is None else self.generation_prompt


_LATER_FIELDS = ("generation_prompt", "think_style", "trim_content", "processor_image", "media_first",
                 "processor_video")
THINK_STYLES = ("qwen3", "drop")


def apply_think_style(style: str | None, messages: list[Message]) -> list[Message]:
    """How assistant turns' ``<think>…</think>`` render, as the family's released template does it.

    ``qwen3``: kept only after the last user query (as ``<think>\nR\n</think>\n\n``; the final turn
    always has the block, empty when it had none); earlier turns lose it. Tool results are
    ``observation`` turns here, so they never count as a query (the template skips
    ``<tool_response>`` user turns for the same reason). ``drop`` (DeepSeek-V3): every assistant
    turn keeps only what follows its last ``</think>``."""
    if style is None:
        return messages
    if style == "drop":
        return [dataclasses.replace(m, content=m.content.split("</think>")[-1]) if m.role == "assistant" else m
                for m in messages]
    last_query = max((k for k, m in enumerate(messages) if m.role == "user"), default=len(messages) - 1)
    out = []
    for k, m in enumerate(messages):
        if m.role not in LOSS_ROLES:
            out.append(m)
            continue
        content, reasoning = m.content, ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
        if k > last_query and (k == len(messages) - 1 or reasoning):
            content = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
        out.append(dataclasses.replace(m, content=content))
    return out


# Qwen2.5-Omni's default system prompt (its model card asks for exactly this one when generating speech)
QWEN2_5_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QWEN2_5_OMNI_SYSTEM = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
                       "perceiving auditory and visual inputs, as well as generating text and speech.")

_CHATML = ChatTemplate(
    name="chatml",
    system="<|im_start|>system\n{content}<|im_end|>\n",
    user="<|im_start|>user\n{content}<|im_end|>\n",
    assistant="<|im_start|>assistant\n{content}<|im_end|>\n",
    observation="<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n",
    function="<|im_start|>assistant\n{content}<|im_end|>\n",
    default_system="You are a helpful assistant.",
    stop_tokens=("<|im_end|>",),
    tool_style="qwen",
)

BUILTIN_TEMPLATES = {
    "chatml": _CHATML,
    # ChatML with Qwen2.5-Omni's system prompt and media tokens, as its processor and chat template write them
    "qwen2_5_omni": dataclasses.replace(
        _CHATML,
        name="qwen2_5_omni",
        default_system=QWEN2_5_OMNI_SYSTEM,
        image="<|vision_bos|><|IMAGE|><|vision_eos|>",
        video="<|vision_bos|><|VIDEO|><|vision_eos|>",
        image_pad="<|IMAGE|>",
        video_pad="<|VIDEO|>",
    ),
    # Qwen2.5 (Instruct): ChatML whose default system prompt names Qwen
    "qwen2_5": dataclasses.replace(_CHATML, name="qwen2_5", default_system=QWEN2_5_SYSTEM),
    # Qwen2-Audio (Instruct): ChatML that numbers its clips, "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\n"; no tools
    "qwen2_audio": dataclasses.replace(_CHATML, name="qwen2_audio", audio="Audio {index}: <|audio_bos|><|AUDIO|><|audio_eos|>\n",
                                       tool_style=None),
    # Qwen3: no default system prompt; <think> blocks kept after the last user query only
    "qwen3": dataclasses.replace(_CHATML, name="qwen3", default_system=None, think_style="qwen3"),
    # Qwen3-Instruct-2507 and Qwen3-VL (Instruct): ChatML without a default system prompt or <think> rules
    "qwen3_nothink": dataclasses.replace(_CHATML, name="qwen3_nothink", default_system=None),
    "qwen3_vl": dataclasses.replace(_CHATML, name="qwen3_vl", default_system=None),
    # InternVL3 / 3.5 (-hf checkpoints): ChatML without a default system prompt; its chat template writes
    # an image as "<IMG_CONTEXT>\n" and InternVLProcessor makes that "<img>" + <IMG_CONTEXT> per token +
    # "</img>"; a video is "<video>\n", whose text "<video>" InternVLProcessor replaces by its frames
    # ("Frame1: <img>" + <IMG_CONTEXT> per token + "</img>", joined by "\n"): here the video's place is one
    # <IMG_CONTEXT> (its tokenizers hold no <video> token) that tokenize.py replaces by the frames
    "internvl": dataclasses.replace(_CHATML, name="internvl", default_system=None,
                                    image="<img><IMG_CONTEXT></img>\n", image_pad="<IMG_CONTEXT>",
                                    processor_image="<IMG_CONTEXT>\n", video="<IMG_CONTEXT>\n",
                                    video_pad="<IMG_CONTEXT>", processor_video="<video>\n"),
    # LLaVA-OneVision (-ov-hf checkpoints: transformers' conversion script's template): ChatML without a
    # default system prompt; each turn's images ("<image>\n"), then videos ("<video>\n"), then its text;
    # LlavaOnevisionProcessor repeats the <image> / <video> token once per feature, nothing around it
    "llava_onevision": dataclasses.replace(_CHATML, name="llava_onevision", default_system=None, tool_style=None,
                                           observation="<|im_start|>tool\n{content}<|im_end|>\n",
                                           image="<image>\n", image_pad="<image>", video="<video>\n",
                                           video_pad="<video>", media_first=True),
    # DeepSeek-V3 (its released template, as TRL keeps it): the system prompt bare after BOS, earlier
    # reasoning dropped from every assistant turn, generation opening a <think> block
    "deepseek3": ChatTemplate(
        name="deepseek3",
        bos="<｜begin▁of▁sentence｜>",
        system="{content}",
        user="<｜User｜>{content}",
        assistant="<｜Assistant｜>{content}<｜end▁of▁sentence｜>",
        observation="<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{content}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>",
        function="<｜Assistant｜>{content}<｜end▁of▁sentence｜>",
        stop_tokens=("<｜end▁of▁sentence｜>",),
        generation_prompt="<｜Assistant｜><think>\n",
        think_style="drop",
    ),
    "llama3": ChatTemplate(
        name="llama3",
        bos="<|begin_of_text|>",
        system="<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>",
        user="<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>",
        assistant="<|start_header_id|>assistant<|end_header_id|>\n\n{content}<|eot_id|>",
        observation="<|start_header_id|>ipython<|end_header_id|>\n\n{content}<|eot_id|>",
        function="<|start_header_id|>assistant<|end_header_id|>\n\n{content}<|eot_id|>",
        stop_tokens=("<|eot_id|>",),
        trim_content=True,  # Llama 3's template writes message['content'] | trim
    ),
    "plain": ChatTemplate(
        name="plain",
        system="{content}\n\n",
        user="{content}\n",
        assistant="{content}<|endoftext|>\n",
        observation="{content}\n",
        function="{content}<|endoftext|>\n",
        stop_tokens=("<|endoftext|>",),
    ),
}


# LLaMA-Factory's template names, for recipes written for it. Its qwen3_vl is Qwen3-VL *Thinking*'s
# template; ours is the Instruct one (LLaMA-Factory: qwen3_vl_nothink); data.template=hf renders any
# checkpoint's own.
ALIASES = {"qwen": "qwen2_5", "qwen2_vl": "chatml", "qwen3_vl_nothink": "qwen3_vl", "qwen2_omni": "qwen2_5_omni",
           "empty": "plain"}


def load_template(name_or_path: str | Path, tokenizer: str | Path | None = None):
    """A built-in template by name (or LLaMA-Factory's name for it, ``ALIASES``), ``hf`` (the
    tokenizer directory's own Jinja template, data/text/hf_template.py), or a YAML file of
    ChatTemplate fields. A YAML template may name ``base: chatml`` and override only some fields.
    """
    name = ALIASES.get(str(name_or_path), str(name_or_path))
    if name == "hf":
        from omniweave.data.text.hf_template import HFChatTemplate

        return HFChatTemplate.from_tokenizer_dir(tokenizer if tokenizer is not None else "demo")
    if name in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[name]
    path = Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"template {str(name_or_path)!r}: not a built-in ({', '.join(BUILTIN_TEMPLATES)}; LLaMA-Factory's names "
            f"{', '.join(ALIASES)}), not 'hf' (the tokenizer directory's own), nor a YAML file"
        )
    spec = yaml.safe_load(path.read_text()) or {}
    known = {f.name for f in dataclasses.fields(ChatTemplate)}
    unknown = set(spec) - known - {"base"}
    if unknown:
        raise ValueError(f"template {path}: unknown keys {sorted(unknown)}; allowed: {sorted(known)} + base")
    base = dataclasses.asdict(BUILTIN_TEMPLATES[spec.pop("base", "chatml")])
    base.update(spec)
    base.setdefault("name", path.stem)
    base["stop_tokens"] = tuple(base.get("stop_tokens") or ())
    return ChatTemplate(**base)


@dataclass
class Rendered:
    """A conversation as one string, with the character ranges that carry loss."""

    text: str
    loss_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) char ranges
    span_weights: list[float] = field(default_factory=list)  # each loss span's turn's loss_weight (empty: all 1)
    message_ends: list[int] = field(default_factory=list)  # char offset after each message
    media_kinds: list[str] = field(default_factory=list)  # "image"/"video"/"audio" in reading order

    def add_loss(self, start: int, end: int, weight: float) -> None:
        self.loss_spans.append((start, end))
        self.span_weights.append(float(weight))


def render(template: ChatTemplate, messages: list[Message], add_generation_prompt: bool = False,
           mask_history: bool = False, train_on_prompt: bool = False) -> Rendered:
    """Render messages (default system prompt added when there is none) to text + loss spans.

    ``add_generation_prompt`` appends the assistant header (e.g. ``<|im_start|>assistant\\n``) so
    a model continues with its reply, as ``apply_chat_template(add_generation_prompt=True)`` does.
    Loss: the assistant / function turns' text and closing tokens, less the turns whose
    ``loss_weight`` is 0; ``mask_history``: the last such turn only; ``train_on_prompt``: every
    turn's (LLaMA-Factory's switches of the same names).
    """
    messages = apply_think_style(template.think_style, messages)
    out = Rendered(text=template.bos)
    if template.default_system is not None and (not messages or messages[0].role != "system"):
        out.text += template.system.format(content=template.default_system)
        if train_on_prompt:
            out.add_loss(len(template.bos), len(out.text), 1.0)
    last = max((k for k, m in enumerate(messages) if m.role in LOSS_ROLES), default=-1)
    for k, msg in enumerate(messages):
        fmt = getattr(template, msg.role, None)
        if fmt is None or msg.role not in ROLES:
            raise ValueError(f"unknown role {msg.role!r}")
        prefix, suffix = fmt.split("{content}")
        content = msg.content.strip() if template.trim_content else msg.content
        if train_on_prompt and msg.loss_weight and len(prefix):  # the turn's header is prompt too
            out.add_loss(len(out.text), len(out.text) + len(prefix), msg.loss_weight)
        out.text += prefix
        carries_loss = bool(msg.loss_weight) and (train_on_prompt or (
            msg.role in LOSS_ROLES and (not mask_history or k == last)))
        loss_from = len(out.text)
        for piece in media_first(content) if template.media_first else _PLACEHOLDER_RE.split(content):
            if piece in _PLACEHOLDER_KINDS:
                kind = _PLACEHOLDER_KINDS[piece]
                if carries_loss and loss_from < len(out.text):
                    out.add_loss(loss_from, len(out.text), msg.loss_weight)
                out.media_kinds.append(kind)
                out.text += getattr(template, kind).replace("{index}", str(out.media_kinds.count(kind)))
                loss_from = len(out.text)
            else:
                out.text += piece
        out.text += suffix
        if carries_loss and loss_from < len(out.text):
            out.add_loss(loss_from, len(out.text), msg.loss_weight)
        out.message_ends.append(len(out.text))
    if add_generation_prompt:
        out.text += template.generation_header()
    return out


def media_first(content: str) -> list[str]:
    """A turn's pieces as ``media_first`` renders them: its image placeholders, then its videos, then
    its audio (each kind in its own order), then its text joined without them."""
    pieces = _PLACEHOLDER_RE.split(content)
    media = sorted((p for p in pieces if p in _PLACEHOLDER_KINDS), key=list(_PLACEHOLDER_KINDS).index)
    return media + ["".join(p for p in pieces if p not in _PLACEHOLDER_KINDS)]


def loss_mask_from_offsets(offsets: list[tuple[int, int]], loss_spans: list[tuple[int, int]]) -> np.ndarray:
    """bool [L]: a token carries loss when its first character lies inside a loss span."""
    starts = np.fromiter((s for s, _ in offsets), dtype=np.int64, count=len(offsets))
    mask = np.zeros(len(offsets), dtype=bool)
    for lo, hi in loss_spans:
        mask |= (starts >= lo) & (starts < hi)
    return mask


def token_loss_weights(offsets: list[tuple[int, int]], rendered: Rendered) -> np.ndarray | None:
    """float32 [L]: each token's loss weight (its turn's ``loss_weight``; 1 outside loss spans), or
    None when every span weighs 1 (the common case: no array at all)."""
    if all(w == 1.0 for w in rendered.span_weights):
        return None
    starts = np.fromiter((s for s, _ in offsets), dtype=np.int64, count=len(offsets))
    weights = np.ones(len(offsets), dtype=np.float32)
    for (lo, hi), w in zip(rendered.loss_spans, rendered.span_weights):
        weights[(starts >= lo) & (starts < hi)] = w
    return weights


def encode_conversation(
    template: ChatTemplate, tokenizer: Tokenizer, messages: list[Message], add_generation_prompt: bool = False,
    mask_history: bool = False, train_on_prompt: bool = False, tools: list[dict] | None = None,
) -> tuple[np.ndarray, np.ndarray, Rendered, list[tuple[int, int]]]:
    """Token ids int32 [L] and unshifted labels int32 [L] (-100 where no loss), before media
    expansion; also the rendering and each token's character offsets. ``tools`` reach templates
    that render them (``renders_tools``)."""
    rendered = template.render(messages, add_generation_prompt, mask_history, train_on_prompt, tools=tools)
    ids, offsets = tokenizer.encode_with_offsets(rendered.text)
    input_ids = np.asarray(ids, dtype=np.int32)
    labels = np.where(loss_mask_from_offsets(offsets, rendered.loss_spans), input_ids, IGNORE_INDEX)
    return input_ids, labels.astype(np.int32), rendered, offsets
