"""Regenerate the small demo tokenizer shipped in ``omniweave/assets/tokenizers/demo/``.

A byte-level BPE (like Qwen2 / Llama-3) trained with ``tokenizers`` on a fixed built-in corpus,
single-threaded, so the output is byte-identical on every run. It holds the ChatML / Qwen2-VL
special tokens and the Llama-3 ones, so every built-in chat template works with it, and the
Qwen2-Audio / Qwen2.5-Omni audio tokens, then Qwen2.5-Omni's vision tokens (``<|vision_bos|>``,
``<|vision_eos|>``, ``<|IMAGE|>``, ``<|VIDEO|>``), then InternVL's ``<img>``, ``</img>``,
``<IMG_CONTEXT>``, ``<video>`` and LLaVA-OneVision's ``<image>``. Those were added after the others: they are
appended after training (ids past the learned vocabulary), so every id the tokenizer had before stays.

    python omniweave/assets/tokenizers/make_demo_tokenizer.py [OUT_DIR]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

QWEN_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
LLAMA3_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
# appended after training (``add_special_tokens``), so no earlier id moves
AUDIO_SPECIAL = [
    "<|audio_bos|>",
    "<|AUDIO|>",
    "<|audio_eos|>",
]
# Qwen2.5-Omni's names for the vision tokens (its template: <|vision_bos|><|IMAGE|><|vision_eos|>)
OMNI_SPECIAL = [
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
]
# InternVL's image tokens (<img><IMG_CONTEXT>…</img>) and video placeholder, LLaVA-OneVision's <image>
INTERNVL_LLAVA_SPECIAL = [
    "<img>",
    "</img>",
    "<IMG_CONTEXT>",
    "<video>",
    "<image>",
]
SPECIAL_TOKENS = QWEN_SPECIAL + LLAMA3_SPECIAL + AUDIO_SPECIAL + OMNI_SPECIAL + INTERNVL_LLAVA_SPECIAL
VOCAB_SIZE = 1024

# Qwen2's pre-tokenizer split pattern (digits one by one, letters grouped, newlines grouped).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_WORDS = (
    "the a an of to and in is it that this what which who where when how why there here image "
    "picture photo video frame clip scene color colour red green blue yellow black white orange "
    "purple shape circle square triangle line dot left right top bottom middle center large small "
    "big little count number one two three four five six seven eight nine ten many few more less "
    "describe answer question user assistant system you are helpful please show see look shows "
    "contains there are is not yes no moving moves static first second last before after time "
    "object objects person people cat dog car tree sky water house text word words sentence"
)


def corpus() -> list[str]:
    """A fixed, varied English corpus: sentences built deterministically from a word list."""
    words = _WORDS.split()
    lines = []
    for i in range(600):
        n = 4 + i % 9
        picked = [words[(i * 7 + j * 13) % len(words)] for j in range(n)]
        sentence = " ".join(picked).capitalize()
        lines.append(f"{sentence}{'.?!,'[i % 4]} {i} {i * 37 % 1000}\n")
    lines.append("You are a helpful assistant.\nWhat is shown in the image?\nThe video shows a red circle.\n")
    return lines


def build(out_dir: Path) -> Path:
    os.environ["RAYON_NUM_THREADS"] = "1"  # deterministic merges
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=QWEN_SPECIAL + LLAMA3_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_special_tokens(AUDIO_SPECIAL)
    tok.add_special_tokens(OMNI_SPECIAL)
    tok.add_special_tokens(INTERNVL_LLAVA_SPECIAL)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 32768,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                      "normalized": False, "single_word": False}
            for t in SPECIAL_TOKENS
        },
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "demo"
    print(f"wrote {build(target)}")
