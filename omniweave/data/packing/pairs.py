"""Preference pairs: what ``omniweave data pack`` stores when the recipe's ``train.phase`` is ``dpo``.

A pair (``data/sources/preference.py``: prompt + chosen answer, the rejected answer in ``meta``) becomes
two documents, ``prompt ‖ chosen`` then ``prompt ‖ rejected``, tokenized like SFT samples but with
loss labels on the final answer only (earlier assistant turns of a multi-turn prompt are context).
The packer sees the pair as ONE item of the two documents' total length, so both sides always
land in the same pack, adjacent, in that order; the loader hands out packs whole, so DP balancing
keeps them together too. The rejected document's media are the chosen one's: the pack stores
their bytes once and the second document's descriptors point at the first's (``same_as``), so the
encoder runs once per pair (``loader.collate_pack`` builds the shared ``feature_rows``).

Rejected with a counted reason: ``not_a_pair`` (no rejected answer: SFT data packed with a DPO
recipe), ``too_long`` (the two documents together exceed ``data.max_len``, or a side would need
truncation), ``identical_pair`` (both sides tokenize alike), ``prompt_not_prefix`` (the chat
template renders the prompt differently once an answer follows: answer tokens cannot be told apart).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from omniweave.data.sample import Message, RawSample, TokenizedSample
from omniweave.data.text.template import IGNORE_INDEX
from omniweave.data.text.tokenize import SampleProcessor, SampleRejected

SIDES = ("chosen", "rejected")


def with_rejected_answer(raw: RawSample) -> RawSample:
    """The sample with its last (assistant) turn replaced by the rejected answer."""
    conv = raw.conversation
    messages = [*conv.messages[:-1], Message(conv.messages[-1].role, conv.meta["rejected"])]
    return dataclasses.replace(raw, conversation=dataclasses.replace(conv, messages=messages))


def answer_document(proc: SampleProcessor, raw: RawSample, prompt: TokenizedSample, who: str,
                    mode: str) -> TokenizedSample:
    """``raw`` tokenized whole with loss labels on its final answer only (after ``prompt``'s tokens,
    which it must start with; earlier assistant turns are context): the document of a preference
    pair's side or of a KTO completion (data/packing/kto.py). ``who`` names it and ``mode`` the
    loss in the rejects' messages (too_long, prompt_not_prefix, no_assistant_turn,
    fractional_loss_weight: a whole-answer loss has no per-turn weight to apply)."""
    n = len(prompt)
    sample = proc.tokenize(raw)
    if sample.truncated:
        raise SampleRejected("too_long", f"the {who} does not fit data.max_len {proc.max_len}")
    if len(sample) <= n or not np.array_equal(sample.input_ids[:n], prompt.input_ids):
        raise SampleRejected("prompt_not_prefix", f"the {who}'s document does not start with the prompt's tokens")
    labels = sample.labels.copy()
    labels[:n] = IGNORE_INDEX  # only the final answer is scored
    if not (labels != IGNORE_INDEX).any():
        raise SampleRejected("no_assistant_turn", f"the {who}'s answer has no loss tokens")
    if any(end > n for _, end, _ in sample.loss_weights or ()):
        raise SampleRejected("fractional_loss_weight", f"the {who}'s answer has a fractional loss_weight, which "
                             f"{mode} cannot honour (it scores whole answers' log-probs)")
    return dataclasses.replace(sample, labels=labels, loss_weights=None)


def tokenize_pair(proc: SampleProcessor, raw: RawSample) -> list[tuple[TokenizedSample, dict]]:
    """[(chosen document, {"side": "chosen"}), (rejected document, {"side": "rejected", "same_media_as": -1})]:
    the second document's media are those of the document before it."""
    if not raw.conversation.meta.get("rejected"):
        raise SampleRejected("not_a_pair", "no rejected answer (convert preference rows: docs/dpo.md)")
    prompt = proc.tokenize_prompt(raw, bounded=True)
    docs = [(answer_document(proc, sample_raw, prompt, f"{side} side", "DPO"), {"side": side})
            for side, sample_raw in zip(SIDES, (raw, with_rejected_answer(raw)))]
    (chosen, _), (rejected, info) = docs
    info["same_media_as"] = -1  # the document before: the chosen side, same prompt, same media
    if np.array_equal(chosen.input_ids, rejected.input_ids):
        raise SampleRejected("identical_pair", "the chosen and rejected answers tokenize alike")
    if len(chosen) + len(rejected) > proc.max_len:
        raise SampleRejected("too_long", f"the pair needs {len(chosen) + len(rejected)} tokens > data.max_len "
                             f"{proc.max_len} (both sides go into one pack)")
    return docs
