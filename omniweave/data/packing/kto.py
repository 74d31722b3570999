"""KTO completions: what ``omniweave data pack`` stores when the recipe's ``train.phase`` is ``kto``.

A KTO row (docs/data.md, *KTO labels*) is a conversation whose final answer is desirable or not
(``meta.kto_tag``). It becomes one document, ``prompt ‖ answer``, tokenized like an SFT sample but
with loss labels on the final answer only, and its tag in the document's record (``kto``).

KTO's reference point z0 (train/kto.py) is the policy's KL from the reference on *mismatched*
completions: TRL 1.16's ``KTOTrainer`` pairs each prompt with the batch's next completion. Here each
pack does the same with its own documents: after its n completions it holds n *KL documents*,
prompt_i ‖ answer_(i+1 mod n), built at write time from the tokens already there (the answer's
positions continue the prompt's), with the prompt's media shared with its completion
(``same_media_as``: no second copy, one encoder pass). The KL documents of a pack hold exactly as
many tokens as its completions, so each completion is planned at twice its length. A pack of one
completion pairs it with itself (mismatched only from two on).

Rejected with a counted reason: ``no_kto_tag`` (SFT or preference data packed with a KTO recipe),
``too_long`` (twice the completion exceeds ``data.max_len``, or it would need truncation),
``prompt_not_prefix`` (the chat template renders the prompt differently once the answer follows),
``no_assistant_turn``, ``fractional_loss_weight`` (KTO scores whole answers), ``media_in_answer``
(an answer's own media could not move to another prompt).
"""

from __future__ import annotations

import numpy as np

from omniweave.data.packing.pairs import answer_document
from omniweave.data.sample import RawSample, TokenizedSample
from omniweave.data.text.template import IGNORE_INDEX
from omniweave.data.text.tokenize import SampleProcessor, SampleRejected

PLANNED_LENGTH_FACTOR = 2  # a completion and its share of the pack's KL documents


def tokenize_kto(proc: SampleProcessor, raw: RawSample) -> list[tuple[TokenizedSample, dict]]:
    """[(the completion's document, {"kto": desirable, "answer_start": the answer's first token})]."""
    tag = raw.conversation.meta.get("kto_tag")
    if tag is None:
        raise SampleRejected("no_kto_tag", "no KTO desirability (a bool `kto_tag`, or `label`, column: docs/dpo.md)")
    prompt = proc.tokenize_prompt(raw, bounded=True)
    n = len(prompt)
    sample = answer_document(proc, raw, prompt, "completion", "KTO")
    if any(m.start + m.length > n for m in sample.media):
        raise SampleRejected("media_in_answer", "the answer holds media; a KL document pairs answers with other "
                             "prompts, so an answer must be text")
    if PLANNED_LENGTH_FACTOR * len(sample) > proc.max_len:
        raise SampleRejected("too_long", f"the completion needs {PLANNED_LENGTH_FACTOR} x {len(sample)} tokens "
                             f"(itself and its KL document's share) > data.max_len {proc.max_len}")
    return [(sample, {"kto": bool(tag), "answer_start": n})]


def kl_document(prompt_doc: TokenizedSample, prompt_len: int, answer_doc: TokenizedSample,
                answer_start: int) -> TokenizedSample:
    """``prompt_doc``'s prompt (its first ``prompt_len`` tokens, its media) followed by
    ``answer_doc``'s answer (from ``answer_start``, with its labels); the answer's positions continue
    the prompt's on every axis (text after the prompt, as the chat template placed it)."""
    tail = len(answer_doc) - answer_start
    prompt_pos = prompt_doc.position_ids[:, :prompt_len]
    start = int(prompt_pos.max()) + 1 if prompt_len else 0
    answer_pos = np.broadcast_to(start + np.arange(tail, dtype=np.int32), (prompt_pos.shape[0], tail))
    return TokenizedSample(
        id=f"{prompt_doc.id}|kl",
        input_ids=np.concatenate([prompt_doc.input_ids[:prompt_len], answer_doc.input_ids[answer_start:]]),
        labels=np.concatenate([np.full(prompt_len, IGNORE_INDEX, dtype=prompt_doc.labels.dtype),
                               answer_doc.labels[answer_start:]]),
        position_ids=np.concatenate([prompt_pos, answer_pos], axis=1).astype(prompt_doc.position_ids.dtype),
        media=list(prompt_doc.media))


def kl_documents(docs: list[tuple[TokenizedSample, dict, dict]]) -> list[tuple[TokenizedSample, dict, dict]]:
    """The KL documents of a pack whose completions are ``docs`` [(document, media bytes, info)]:
    prompt_i ‖ answer_(i+1 mod n), each sharing completion i's media (``same_media_as`` -n)."""
    n = len(docs)
    out = []
    for i, (sample, media, info) in enumerate(docs):
        other, _, other_info = docs[(i + 1) % n]
        kl = kl_document(sample, int(info["answer_start"]), other, int(other_info["answer_start"]))
        out.append((kl, media, {"index": info["index"], "key": info["key"], "kto_kl": True, "same_media_as": -n}))
    return out
