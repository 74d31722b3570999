"""RL prompts: what ``omniweave data pack`` stores when the recipe's ``train.phase`` is an RL phase.

A prompt is a converted conversation without its trailing assistant turn(s), tokenized with the
assistant header appended (``SampleProcessor.tokenize_prompt``: ids, M-RoPE positions, media
grids, computed once offline like SFT samples), plus its reference answer: the row's ``solution``
column if it has one, else the content of its last assistant turn. A prompt without an answer, or
longer than ``data.max_len``, is rejected with its reason (``no_reference_answer``, ``too_long``).
Each prompt is its own pack (algorithm ``single``), so the loader hands out prompts, seeded,
resumable and split over the data-parallel ranks exactly as it hands out SFT packs.
"""

from __future__ import annotations

from omniweave.data.sample import RawSample, TokenizedSample
from omniweave.data.text.tokenize import SampleProcessor, SampleRejected

RL_PHASES = ("grpo",)
PREFERENCE_PHASES = ("dpo", "orpo", "simpo")  # pairs of answers (train/loss.py PAIR_PHASES)
KTO_PHASES = ("kto",)  # unpaired completions tagged desirable or not (data/packing/kto.py)
VLA_PHASES = ("vla",)  # robot frames: observation prompt + action chunk (data/packing/vla.py)
KIND_SFT, KIND_PROMPTS, KIND_PAIRS, KIND_KTO, KIND_VLA = "sft", "prompts", "pairs", "kto", "vla"
DIFFUSION_PHASES = ("diffusion",)  # video clips as offline latents + text states (diffusion/data.py)
KIND_DIFFUSION = "diffusion"


def dataset_kind(phase: str | None) -> str:
    """What ``data pack`` writes for a recipe's ``train.phase``: training packs, RL prompts or
    preference pairs (data/packing/pairs.py), KTO completions (data/packing/kto.py) or VLA frames
    (data/packing/vla.py) or video-diffusion clips (diffusion/data.py)."""
    if phase in KTO_PHASES:
        return KIND_KTO
    if phase in VLA_PHASES:
        return KIND_VLA
    if phase in DIFFUSION_PHASES:
        return KIND_DIFFUSION
    return KIND_PROMPTS if phase in RL_PHASES else KIND_PAIRS if phase in PREFERENCE_PHASES else KIND_SFT


def reference_answer(raw: RawSample) -> str:
    conv = raw.conversation
    solution = conv.meta.get("solution")
    if solution is not None and str(solution).strip():
        return str(solution).strip()
    last = conv.messages[-1] if conv.messages else None
    if last is not None and last.role == "assistant" and last.content.strip():
        return last.content.strip()
    raise SampleRejected("no_reference_answer", "neither a 'solution' column nor a final assistant turn")


def tokenize_rl_prompt(proc: SampleProcessor, raw: RawSample) -> tuple[TokenizedSample, str]:
    """(the tokenized prompt, its reference answer)."""
    answer = reference_answer(raw)
    sample = proc.tokenize_prompt(raw, bounded=True)
    if len(sample) > proc.max_len:
        raise SampleRejected("too_long", f"prompt of {len(sample)} tokens > data.max_len {proc.max_len}")
    return sample, answer
