"""Load a Hugging Face tokenizer directory offline, with the fast Rust ``tokenizers`` library.

    tok = load_tokenizer("demo")                  # the small tokenizer shipped with omniweave
    tok = load_tokenizer("/models/Qwen2-VL-2B")   # any directory holding tokenizer.json
    ids, offsets = tok.encode_with_offsets("<|im_start|>user\\nhi<|im_end|>\\n")

Only ``tokenizer.json`` (+ ``tokenizer_config.json`` for the special-token names) is read; nothing
is ever downloaded. Text is encoded *without* the tokenizer's own post-processing (no automatic
BOS): chat templates spell out every special token themselves.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as RustTokenizer

DEMO_TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "assets" / "tokenizers" / "demo"
# Files of a tokenizer directory that define its behaviour (hashed into the fingerprint).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
)


def resolve_tokenizer_dir(name_or_path: str | Path) -> Path:
    """``"demo"`` -> the shipped demo tokenizer; otherwise a directory holding tokenizer.json."""
    path = DEMO_TOKENIZER_DIR if str(name_or_path) == "demo" else Path(name_or_path)
    if path.is_file() and path.name == "tokenizer.json":
        path = path.parent
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"tokenizer {str(name_or_path)!r}: no tokenizer.json in {path} "
            "(pass a Hugging Face tokenizer directory, or 'demo')"
        )
    return path


def _token_name(value) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


@dataclass
class Tokenizer:
    """A thin, picklable wrapper: ids + character offsets, special-token lookup, decode."""

    path: Path
    backend: RustTokenizer
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None

    def __getstate__(self):  # workers receive the tokenizer through pickle
        return {"path": self.path}

    def __setstate__(self, state):
        self.__dict__.update(load_tokenizer(state["path"]).__dict__)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and, per token, its (start, end) character span in ``text``."""
        enc = self.backend.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_id(self, token: str) -> int:
        """The id of a single (special) token; a clear error if the vocabulary lacks it."""
        tid = self.backend.token_to_id(token)
        if tid is None:
            raise KeyError(f"tokenizer {self.path} has no token {token!r}")
        return tid

    def has_token(self, token: str) -> bool:
        return self.backend.token_to_id(token) is not None

    @functools.cached_property
    def special_tokens(self) -> tuple[str, ...]:
        """The contents of the added tokens marked special (``<|im_end|>``, ``<|image_pad|>`` …):
        typed in a message's text, the tokenizer would turn each into its control token."""
        added = self.backend.get_added_tokens_decoder().values()
        return tuple(sorted({t.content for t in added if t.special}, key=lambda c: (-len(c), c)))

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry, in characters: no token covers more characters of text than
        this (a byte-level entry's characters are bytes, and a character is at least one byte), so
        ``len(text) // max_token_chars`` tokens is a lower bound computed without tokenizing."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)))

    def sha256(self) -> str:
        """Hash of the files that define the tokenizer (stable across copies of the directory)."""
        digest = hashlib.sha256()
        for name in TOKENIZER_FILES:
            file = self.path / name
            if file.is_file():
                digest.update(name.encode() + b"\0" + file.read_bytes() + b"\0")
        return digest.hexdigest()


def load_tokenizer(name_or_path: str | Path) -> Tokenizer:
    path = resolve_tokenizer_dir(name_or_path)
    backend = RustTokenizer.from_file(str(path / "tokenizer.json"))
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    return Tokenizer(
        path=path,
        backend=backend,
        eos_token=_token_name(config.get("eos_token")),
        bos_token=_token_name(config.get("bos_token")),
        pad_token=_token_name(config.get("pad_token")),
    )
