"""``data.template: hf``: render with the tokenizer directory's own Jinja chat template.

The text is what ``tokenizer.apply_chat_template`` renders (transformers' own renderer, the same
special-token variables), so the token ids are the model's. Messages go to the template as
Hugging Face messages: a turn with media placeholders becomes content parts (``{"type": "text"}``,
``{"type": "image"}`` …, as Qwen's VL templates read them; text-only turns stay strings), a tool-call
turn an assistant message with ``tool_calls``, a tool result a ``tool`` message, and the row's tool
definitions the ``tools`` variable.

Which characters carry loss, exactly:
- a template with ``{% generation %}`` blocks: those blocks (transformers'
  ``return_assistant_tokens_mask``), one per assistant message in order;
- otherwise by rendering prefixes: an assistant turn k carries loss from the end of
  ``render(messages[:k], add_generation_prompt=True)`` to the end of ``render(messages[:k+1])``,
  which must both be prefixes of the whole rendering. A template that re-renders earlier turns
  once more follow (Qwen3's drops their ``<think>`` blocks) has no such prefixes; its multi-turn
  samples are counted rejects (``template_not_prefix_stable``) naming the fix: the family's
  built-in template (``qwen3``), or a template with ``{% generation %}`` blocks.
Media never carry loss (tokenize.py masks them), a turn with ``loss_weight`` 0 carries none,
``mask_history`` keeps the last assistant turn only, ``train_on_prompt`` labels every turn from
its start (the previous turn's end) to its end.

Where the template is read from, first found: ``chat_template.jinja``, ``chat_template.json``
(a processor's), ``tokenizer_config.json``'s ``chat_template`` (a string, or the ``default`` of a
list of named templates).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from omniweave.data.sample import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, Message
from omniweave.data.text.tokenizer import _token_name, resolve_tokenizer_dir
from omniweave.data.text.tools import ToolError, parse_calls

_KINDS = {IMAGE_PLACEHOLDER: "image", VIDEO_PLACEHOLDER: "video", AUDIO_PLACEHOLDER: "audio"}
_SPLIT = re.compile("(" + "|".join(map(re.escape, _KINDS)) + ")")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
# each media kind's (start, pad, end) tokens as the families' templates spell them; the first the template holds wins
_MEDIA = {"image": (("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"), ("<|vision_bos|>", "<|IMAGE|>", "<|vision_eos|>")),
          "video": (("<|vision_start|>", "<|video_pad|>", "<|vision_end|>"), ("<|vision_bos|>", "<|VIDEO|>", "<|vision_eos|>")),
          "audio": (("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"), ("<|audio_start|>", "<|audio_pad|>", "<|audio_end|>"))}
_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "observation": "tool"}


class TemplateRejected(ValueError):
    """A sample this template cannot render with exact loss spans; ``reason`` is the counted reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def read_chat_template(tokenizer_dir: Path) -> tuple[str, str] | None:
    """(template text, the file it came from) of a tokenizer / processor directory, or None."""
    jinja = tokenizer_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(), jinja.name
    for name in ("chat_template.json", "tokenizer_config.json"):
        file = tokenizer_dir / name
        if not file.is_file():
            continue
        value = json.loads(file.read_text()).get("chat_template")
        if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            value = {t.get("name"): t.get("template") for t in value}.get("default")
        if isinstance(value, str) and value:
            return value, name
    return None


@dataclass(frozen=True)
class HFChatTemplate:
    """The directory's Jinja chat template, with the attributes tokenize.py reads of a ChatTemplate."""

    source: str  # the Jinja text
    origin: str  # where it was read from (for messages)
    special: dict = field(default_factory=dict)  # bos_token, eos_token … as the template sees them
    name: str = "hf"
    stop_tokens: tuple[str, ...] = ()
    image: str = "<|vision_start|><|image_pad|><|vision_end|>"
    video: str = "<|vision_start|><|video_pad|><|vision_end|>"
    audio: str = "<|audio_bos|><|AUDIO|><|audio_eos|>"
    image_pad: str = "<|image_pad|>"
    video_pad: str = "<|video_pad|>"
    audio_pad: str = "<|AUDIO|>"
    default_system = None
    tool_style = None
    renders_tools = True  # tools reach render(); a ChatTemplate has them in its messages already

    @classmethod
    def from_tokenizer_dir(cls, name_or_path: str | Path) -> "HFChatTemplate":
        path = resolve_tokenizer_dir(name_or_path)
        found = read_chat_template(path)
        if found is None:
            raise FileNotFoundError(f"data.template=hf: {path} has no chat template (chat_template.jinja, "
                                    "chat_template.json, or tokenizer_config.json's chat_template); name a "
                                    "built-in template instead")
        source, origin = found
        # InternVL's processor frames its image tokens; LLaVA-OneVision's template reads only content parts and
        # moves media first (its released text writes {{ '<image>\n' }}, an export of ours "image": "<image>\n")
        for signs, family in ((("<IMG_CONTEXT>",), "internvl"), (("{{ '<image>", '"image": "<image>'), "llava_onevision")):
            if any(sign in source for sign in signs):
                raise FileNotFoundError(
                    f"data.template=hf: {path}'s chat template is {family}'s, whose images the built-in template "
                    f"renders exactly (tests/test_chat_templates.py); use the built-in template: {family}")
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        special = {k: _token_name(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        media = {kind: next((t for t in spellings if t[1] in source), spellings[0]) for kind, spellings in _MEDIA.items()}
        eos = special["eos_token"]
        return cls(source=source, origin=f"{path}/{origin}", special={k: v for k, v in special.items() if v},
                   stop_tokens=(eos,) if eos else (),
                   **{kind: "".join(tokens) for kind, tokens in media.items()},
                   **{f"{kind}_pad": tokens[1] for kind, tokens in media.items()})

    def spec(self) -> dict:
        """What decides the text (for fingerprints): the template's hash and the pads it uses."""
        return {"name": self.name, "jinja_sha256": hashlib.sha256(self.source.encode()).hexdigest(),
                "special": self.special, "pads": [self.image_pad, self.video_pad, self.audio_pad]}

    # ------------------------------------------------------------------ rendering

    def _render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = False,
                with_generation_indices: bool = False):
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            texts, indices = render_jinja_template([messages], tools=tools, chat_template=self.source,
                                                   add_generation_prompt=add_generation_prompt,
                                                   return_assistant_tokens_mask=with_generation_indices,
                                                   **self.special)
        except Exception as e:  # the template's own raise_exception, or a Jinja error on this sample
            raise TemplateRejected("template_error", f"{self.origin}: {type(e).__name__}: {e}") from None
        return (texts[0], indices[0]) if with_generation_indices else texts[0]

    def render(self, messages: list[Message], add_generation_prompt: bool = False, mask_history: bool = False,
               train_on_prompt: bool = False, tools: list[dict] | None = None):
        """The conversation as one string with its loss spans (template.Rendered)."""
        from omniweave.data.text.template import LOSS_ROLES, Rendered

        hf = [hf_message(m) for m in messages]
        text = self._render(hf, tools, add_generation_prompt)
        kinds = [_KINDS[p] for m in messages for p in _SPLIT.findall(m.content)]
        loss_turns = [k for k, m in enumerate(messages) if m.role in LOSS_ROLES or train_on_prompt]
        if mask_history and not train_on_prompt:
            loss_turns = loss_turns[-1:]
        loss_turns = [k for k in loss_turns if messages[k].loss_weight]
        if _GENERATION.search(self.source) and not train_on_prompt:
            spans = self._generation_spans(hf, tools, messages, loss_turns)
        else:
            spans = [self._prefix_span(hf, tools, text, k, train_on_prompt) for k in loss_turns]
        out = Rendered(text=text, media_kinds=kinds)
        for (start, end), k in zip(spans, loss_turns):
            if start < end:
                out.add_loss(start, end, messages[k].loss_weight)
        return out

    def _prefix_span(self, hf: list[dict], tools, text: str, k: int, whole_turn: bool) -> tuple[int, int]:
        end_text = self._render(hf[: k + 1], tools)
        if whole_turn:  # the turn from the previous one's end
            start = len(self._render(hf[:k], tools)) if k else 0
        else:
            start_text = self._render(hf[:k], tools, add_generation_prompt=True)
            if not end_text.startswith(start_text):
                raise self._unstable(k)
            start = len(start_text)
        if not text.startswith(end_text):
            raise self._unstable(k)
        return start, len(end_text)

    def _unstable(self, k: int) -> TemplateRejected:
        return TemplateRejected("template_not_prefix_stable", (
            f"{self.origin} renders turn {k} differently once later turns follow, so its loss span is not "
            "exact; use the family's built-in template (e.g. data.template=qwen3) or a chat template with "
            "{% generation %} blocks"))

    def _generation_spans(self, hf, tools, messages, loss_turns) -> list[tuple[int, int]]:
        _, indices = self._render(hf, tools, with_generation_indices=True)
        assistant_turns = [k for k, m in enumerate(hf) if m["role"] == "assistant"]
        if len(indices) != len(assistant_turns):
            raise TemplateRejected("template_generation_mismatch", (
                f"{self.origin} marks {len(indices)} {{% generation %}} blocks for {len(assistant_turns)} assistant turns"))
        by_turn = dict(zip(assistant_turns, indices))
        return [tuple(by_turn[k]) for k in loss_turns]  # loss turns are assistant messages (function: tool_calls)


def hf_message(m: Message) -> dict:
    """One of our turns as a Hugging Face chat message (module doc)."""
    if m.role == "function":
        try:
            text, calls = parse_calls(m.content)
        except ToolError as e:
            raise TemplateRejected(e.reason, str(e)) from None
        return {"role": "assistant", "content": text,
                "tool_calls": [{"type": "function", "function": c} for c in calls]}
    role = _ROLES[m.role]
    pieces = [p for p in _SPLIT.split(m.content) if p]
    if not any(p in _KINDS for p in pieces):
        return {"role": role, "content": m.content}
    return {"role": role, "content": [{"type": _KINDS[p]} if p in _KINDS else {"type": "text", "text": p}
                                      for p in pieces]}


def verify_template(name: str, tokenizer: str, fallback: str = "chatml") -> str:
    """``hf verify --template``: ``auto`` is the directory's own template (``hf``) when its tokenizer
    has one, else ``fallback`` (the family's built-in: chatml, internvl); any other name as given."""
    if name != "auto":
        return name
    try:
        return "hf" if read_chat_template(resolve_tokenizer_dir(tokenizer)) else fallback
    except FileNotFoundError:
        return fallback
