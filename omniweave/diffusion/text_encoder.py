"""The frozen text encoder of Wan video diffusion: umT5 (transformers' ``UMT5EncoderModel``; a plain
``T5EncoderModel`` is accepted too) and its tokenizer, giving the text states the DiT cross-attends to.

    enc = WanTextEncoder.from_pretrained("Wan2.1-T2V-1.3B-Diffusers", dtype=torch.bfloat16, device="cuda")
    states = enc.encode(["a cat surfing", ""])   # [len_i, D] each: the prompt's true length, no padding
    text = enc.pad(states)                         # [B, 512, D] zero padded: what the pipeline feeds the DiT
    empty = enc.empty_states()                     # encode([""])[0], cached: caption dropout / CFG negative

What :meth:`encode` computes is diffusers' ``WanPipeline._get_t5_prompt_embeds`` (0.42.1) before its
zero padding, and ``pad(encode(p), L)`` equals ``_get_t5_prompt_embeds(p, max_sequence_length=L)``
(tests/test_wan_text_encoder.py: bit-identical, fp32):

- each prompt is cleaned as the pipeline cleans it (``prompt_clean``: ``ftfy.fix_text`` when ftfy is
  installed, HTML unescaped twice, runs of white space made one space, stripped);
- tokenized with the special tokens (umT5 appends ``</s>``: the empty prompt is one token), truncated
  to ``max_sequence_length`` (512, Wan's ``text_len``) and padded to it, with the attention mask;
- run through the encoder with that mask; each row's states are cut to its true length (the mask's
  count) and cast to the encoder's dtype.

``padding="longest"`` pads each batch only to its longest prompt instead (cheaper for offline text
states; the masked keys add exact zeros, the rows differ from the pipeline's by float summation
order only).

Research notes 4.3 / 4.5: the official model and diffusers cross-attend to all 512 slots, zeros
included, so store the true-length states offline, :meth:`pad` them to 512 at train time and do not
mask; caption dropout and the CFG negative prompt use the *encoded* empty prompt (:meth:`empty_states`).

Construction: :meth:`from_pretrained` reads a local directory (no download): a diffusers Wan pipeline
root (``text_encoder/`` + ``tokenizer/``), its ``text_encoder/`` folder (the tokenizer then from the
sibling ``tokenizer/``), or one folder holding both. :meth:`tiny` / :meth:`from_config` build a random
umT5 for tests and the demo over omniweave's shipped demo tokenizer (data/text/tokenizer.py), given a
T5-like end-of-sequence token (its ``<|im_end|>`` appended to every prompt) so an empty prompt is one
token, as with umT5's own tokenizer. The encoder's vocabulary must cover the tokenizer's.

The module is frozen and stays in eval mode (``train()`` does not switch it; dropout never runs);
everything runs under ``torch.no_grad`` on the encoder's device, in its dtype.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from omniweave.diffusion.frozen import FrozenCodec

WAN_TEXT_LEN = 512  # Wan's text_len: the pipeline's max_sequence_length and the DiT's cross-attention slots
ENCODER_TYPES = ("umt5", "t5")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "spiece.model")


def prompt_clean(text: str) -> str:
    """diffusers' Wan ``prompt_clean``: ftfy (when installed, as diffusers checks), HTML unescaped
    twice, white-space runs -> one space, stripped. ``regex`` (a transformers dependency) as diffusers
    uses it: its ``\\s`` is Unicode's White_Space, not quite ``re``'s."""
    try:
        import ftfy
    except ImportError:
        ftfy = None
    try:
        import regex as re
    except ImportError:  # pragma: no cover - transformers requires regex
        import re
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


def _guard_torchvision() -> None:
    """Before transformers' first import: a torchvision that does not load beside this torch (pip's
    CUDA build next to a CPU torch) is hidden, or every transformers model class fails to import
    (models/hf/torchvision_guard.py); a working one is left alone."""
    from omniweave.models.hf.torchvision_guard import torchvision_loads

    torchvision_loads()


def _encoder_class(model_type: str):
    _guard_torchvision()
    from transformers import T5EncoderModel, UMT5EncoderModel

    if model_type not in ENCODER_TYPES:
        raise ValueError(f"text encoder model_type {model_type!r}: WanTextEncoder takes umt5 (Wan's umT5-XXL) or t5")
    return UMT5EncoderModel if model_type == "umt5" else T5EncoderModel


def demo_tokenizer():
    """omniweave's shipped demo tokenizer (transformers' AutoTokenizer, offline) with a T5-like
    post-processor: ``<|im_end|>`` appended to every text, so "" is one token, as umT5's ``</s>``."""
    from tokenizers import processors

    _guard_torchvision()
    from transformers import AutoTokenizer

    from omniweave.data.text.tokenizer import resolve_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_tokenizer_dir("demo")))
    eos = tok.eos_token
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, tok.eos_token_id)])
    return tok


def _load_tokenizer(tokenizer):
    if tokenizer is None or isinstance(tokenizer, (str, Path)) and str(tokenizer) == "demo":
        return demo_tokenizer()
    if isinstance(tokenizer, (str, Path)):
        _guard_torchvision()
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer))
    return tokenizer


def _has_tokenizer(path: Path) -> bool:
    return any((path / f).is_file() for f in _TOKENIZER_FILES)


def _locate(path: Path) -> tuple[Path, Path]:
    """(encoder dir, tokenizer dir) of a pipeline root, its ``text_encoder/``, or one folder with both."""
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a directory (a Wan pipeline root or its text_encoder/ folder)")
    if (path / "text_encoder" / "config.json").is_file():
        model_dir = path / "text_encoder"
        tok_dir = path / "tokenizer" if _has_tokenizer(path / "tokenizer") else model_dir
    elif (path / "config.json").is_file():
        model_dir = path
        tok_dir = path if _has_tokenizer(path) else path.parent / "tokenizer"
    else:
        raise FileNotFoundError(f"{path}: no config.json and no text_encoder/config.json (a diffusers Wan pipeline "
                                "root, its text_encoder/ folder, or an HF umT5/T5 encoder directory)")
    if not _has_tokenizer(tok_dir):
        raise FileNotFoundError(f"{path}: no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {tok_dir}")
    return model_dir, tok_dir


class WanTextEncoder(FrozenCodec):
    """Frozen umT5 / T5 encoder + tokenizer (see the module docstring)."""

    def __init__(self, model: nn.Module, tokenizer, max_sequence_length: int = WAN_TEXT_LEN):
        super().__init__()
        model_type = getattr(model.config, "model_type", None)
        if model_type not in ENCODER_TYPES or not hasattr(model, "encoder"):
            raise ValueError(f"WanTextEncoder wraps transformers' UMT5EncoderModel / T5EncoderModel, got "
                             f"{type(model).__name__} (model_type {model_type!r})")
        vocab, n_tok = int(model.config.vocab_size), len(tokenizer)
        if vocab < n_tok:
            raise ValueError(f"the text encoder's vocabulary ({vocab}) is smaller than its tokenizer's ({n_tok} "
                             "tokens): ids past the embedding would fail")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token: padding to max_sequence_length needs one")
        if max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_sequence_length = int(max_sequence_length)
        self._empty: dict[tuple, Tensor] = {}

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None,
                        max_sequence_length: int = WAN_TEXT_LEN) -> WanTextEncoder:
        """A local umT5 / T5 encoder and its tokenizer (no download): a diffusers Wan pipeline root,
        its ``text_encoder/`` folder, or one folder with both. ``dtype`` None = float32 (as diffusers
        and ``load_hf``); transformers keeps T5's ``wo`` layers in fp32 under bf16, as in the pipeline."""
        _guard_torchvision()
        from transformers import AutoTokenizer

        model_dir, tok_dir = _locate(Path(path))
        config = json.loads((model_dir / "config.json").read_text())
        model_cls = _encoder_class(config.get("model_type"))
        model = model_cls.from_pretrained(str(model_dir), dtype=dtype or torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
        return cls(model.to(device) if device is not None else model, tokenizer, max_sequence_length)

    @classmethod
    def from_config(cls, config: dict[str, Any] | Any, tokenizer="demo", seed: int = 0,
                    dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                    max_sequence_length: int = WAN_TEXT_LEN) -> WanTextEncoder:
        """A randomly initialised encoder from a ``UMT5Config`` / ``T5Config`` (or its dict: ``model_type``
        "umt5" unless given) over ``tokenizer`` ("demo", a directory, or a tokenizer object); the
        vocabulary defaults to the tokenizer's size. Seeded without touching the global RNG."""
        _guard_torchvision()
        from transformers import T5Config, UMT5Config

        tok = _load_tokenizer(tokenizer)
        if isinstance(config, dict):
            config = dict(config)
            model_type = config.pop("model_type", "umt5")
            if model_type not in ENCODER_TYPES:
                raise ValueError(f"model_type {model_type!r}: umt5 or t5")
            config.setdefault("vocab_size", len(tok))
            config.setdefault("pad_token_id", tok.pad_token_id)
            config.setdefault("eos_token_id", tok.eos_token_id)
            config = (UMT5Config if model_type == "umt5" else T5Config)(**config)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = _encoder_class(config.model_type)(config)
        return cls(model.to(device=device, dtype=dtype or torch.float32), tok, max_sequence_length)

    @classmethod
    def tiny(cls, d_model: int = 32, num_layers: int = 2, num_heads: int = 4, d_kv: int = 8, d_ff: int = 64,
             tokenizer="demo", seed: int = 0, **kwargs) -> WanTextEncoder:
        """A tiny random umT5 (``d_model`` wide) over the demo tokenizer: tests and the demo.
        ``kwargs``: ``dtype``, ``device``, ``max_sequence_length``."""
        config = dict(d_model=d_model, num_layers=num_layers, num_heads=num_heads, d_kv=d_kv, d_ff=d_ff,
                      relative_attention_num_buckets=8, relative_attention_max_distance=32,
                      dropout_rate=0.0, feed_forward_proj="gated-gelu")
        return cls.from_config(config, tokenizer=tokenizer, seed=seed, **kwargs)

    def save_pretrained(self, path: str | Path) -> Path:
        """A diffusers-pipeline-like layout: ``path/text_encoder/`` (config.json + safetensors) and
        ``path/tokenizer/``, which :meth:`from_pretrained` (and diffusers' pipelines) read back."""
        path = Path(path)
        self.model.save_pretrained(str(path / "text_encoder"))
        self.tokenizer.save_pretrained(str(path / "tokenizer"))
        return path

    # ---- state -----------------------------------------------------------------------------

    @property
    def dim(self) -> int:
        return int(self.model.config.d_model)

    # ---- encoding --------------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, prompts: list[str], max_sequence_length: int | None = None, batch_size: int | None = None,
               padding: str = "max_length", clean: bool = True) -> list[Tensor]:
        """Each prompt's text states ``[len_i, D]`` (true length after truncation to
        ``max_sequence_length``; the encoder's dtype and device). ``batch_size`` prompts run at once
        (None: all); ``padding`` "max_length" (the pipeline's) or "longest"."""
        if isinstance(prompts, str):
            raise TypeError("encode takes a list of prompts (a single prompt: [prompt])")
        if padding not in ("max_length", "longest"):
            raise ValueError(f"padding must be 'max_length' or 'longest', got {padding!r}")
        length = int(max_sequence_length or self.max_sequence_length)
        texts = [prompt_clean(p) if clean else p for p in prompts]
        step = max(1, int(batch_size or len(texts) or 1))
        out: list[Tensor] = []
        for i in range(0, len(texts), step):
            batch = self.tokenizer(texts[i:i + step], padding=padding, max_length=length, truncation=True,
                                   add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
            ids, mask = batch.input_ids.to(self.device), batch.attention_mask.to(self.device)
            states = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.to(self.dtype)
            out += [s[:n] for s, n in zip(states, mask.gt(0).sum(1).tolist())]
        return out

    def pad(self, states: list[Tensor], max_len: int = WAN_TEXT_LEN) -> Tensor:
        """``[B, max_len, D]``: each ``[len_i, D]`` followed by zero rows (the pipeline's layout)."""
        if not states:
            raise ValueError("pad needs at least one [len, D] tensor")
        return pad_states(states, max_len)

    def empty_states(self) -> Tensor:
        """``encode([""])[0]`` (cached per device / dtype / length): the encoded empty prompt that
        caption dropout and the default CFG negative prompt use."""
        key = (self.device, self.dtype, self.max_sequence_length)
        if key not in self._empty:
            self._empty[key] = self.encode([""])[0]
        return self._empty[key]

    def forward(self, prompts: list[str], max_len: int = WAN_TEXT_LEN) -> Tensor:
        """``pad(encode(prompts, max_len), max_len)``: what the pipeline gives the DiT."""
        return self.pad(self.encode(prompts, max_sequence_length=max_len), max_len)


def pad_states(states: list[Tensor], max_len: int = WAN_TEXT_LEN) -> Tensor:
    """``[B, max_len, D]`` zero padding of ``[len_i, D]`` text states (len_i <= max_len)."""
    dims = {s.shape[-1] for s in states}
    if any(s.dim() != 2 for s in states) or len(dims) != 1:
        raise ValueError(f"text states must be [len, D] with one D, got {[tuple(s.shape) for s in states]}")
    too_long = [s.shape[0] for s in states if s.shape[0] > max_len]
    if too_long:
        raise ValueError(f"text states of length {too_long} exceed max_len {max_len}")
    first = states[0]
    out = first.new_zeros(len(states), max_len, first.shape[-1])
    for i, s in enumerate(states):
        out[i, :s.shape[0]] = s.to(first.dtype)
    return out


@dataclass
class TextEncoderConfig:
    """``model.text_encoder`` (a recipe's frozen codec: ``data pack`` encodes the captions with it,
    ``generate`` the prompts): a local umT5 / T5 directory (``path``: a diffusers Wan pipeline root,
    its ``text_encoder/``, or an HF encoder folder with its tokenizer), or, without one, a random
    tiny umT5 of the fields below over ``tokenizer`` (tests and the demo; ``seed`` fixes it)."""

    path: str | None = None
    d_model: int = 32
    num_layers: int = 2
    num_heads: int = 4
    d_kv: int = 8
    d_ff: int = 64
    tokenizer: str = "demo"
    seed: int = 0
    max_sequence_length: int = WAN_TEXT_LEN


def build_text_encoder(config: TextEncoderConfig) -> WanTextEncoder:
    """The registered ``text_encoder`` ``umt5``: :meth:`WanTextEncoder.from_pretrained` of
    ``config.path``, else :meth:`WanTextEncoder.tiny` of the other fields."""
    if config.path:
        return WanTextEncoder.from_pretrained(config.path, max_sequence_length=config.max_sequence_length)
    return WanTextEncoder.tiny(d_model=config.d_model, num_layers=config.num_layers, num_heads=config.num_heads,
                               d_kv=config.d_kv, d_ff=config.d_ff, tokenizer=config.tokenizer, seed=config.seed,
                               max_sequence_length=config.max_sequence_length)


def _register() -> None:
    from omniweave.models.registry import register

    register("text_encoder", "umt5", TextEncoderConfig)(build_text_encoder)


_register()
