"""Training phases and their labels.

``sft``: the packs' own labels (assistant turns only, set by the chat template at pack time).
``pretrain``: every token predicts the next one *within its document* (the last token of a
document predicts nothing), except that vision placeholder tokens are never targets. The same
packed dataset serves both phases.
"""

from __future__ import annotations

import torch

# dpo, orpo, simpo: pairs of answers, their labels as packed, their own losses (train/dpo.py, train/preference.py)
PHASES = ("sft", "pretrain", "dpo", "orpo", "simpo", "kto", "vla", "diffusion")
PAIR_PHASES = ("dpo", "orpo", "simpo")
ANSWER_PHASES = (*PAIR_PHASES, "kto")  # labelled on the final answers by data pack, kept as packed
AS_PACKED = ("sft", *ANSWER_PHASES, "vla", "diffusion")  # the packs' own labels (vla: none, or co-trained text; diffusion: none)


def pretrain_labels(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, ignore_ids: tuple[int, ...] = ()) -> torch.Tensor:
    """Shifted next-token labels [L] for a packed row: labels[i] = input_ids[i + 1] inside a
    document, -100 at each document's last token and where the target is in ``ignore_ids``."""
    labels = torch.full_like(input_ids, -100)
    labels[:-1] = input_ids[1:]
    ends = cu_seqlens[1:].to(torch.long) - 1  # last token of each document
    labels[ends[ends >= 0]] = -100
    for t in ignore_ids:
        labels[labels == t] = -100
    return labels


def apply_phase(packs: list[dict], phase: str, ignore_ids: tuple[int, ...]) -> list[dict]:
    """The micro-batches with the labels (and loss-token counts) of ``phase``."""
    if phase not in PHASES:
        raise ValueError(f"train.phase={phase!r}; choose one of {PHASES}")
    if phase in AS_PACKED:
        return packs
    out = []
    for p in packs:
        labels = pretrain_labels(p["input_ids"], p["cu_seqlens"], ignore_ids)
        # a turn's loss_weight says nothing about next-token targets: pretraining drops it
        token_data = {k: v for k, v in p.get("token_data", {}).items() if k != "loss_weight"}
        rest = {k: v for k, v in p.items() if k != "token_data"}
        out.append({**rest, "labels": labels, "num_loss_tokens": int((labels != -100).sum()),
                    **({"token_data": token_data} if token_data else {})})
    return out


def drop_skipped_docs(packs: list[dict], skips: list[dict]) -> list[dict]:
    """The micro-batches with no loss on the documents whose media did not decode (the loader's
    ``take_media_skips``: ``row`` = which micro-batch, ``tokens`` = the document's [start, end)). The
    tokens stay (every rank keeps its shapes, the step runs); after the phase's labels, so
    ``pretrain`` drops them too. Per-token ``token_data`` (DPO's ``pair_slot``) is zeroed there as
    well: a pair whose media failed adds nothing to the log-prob sums, and DPO leaves it out of its
    loss, statistics and pair normaliser (``dpo.live_pairs``). A robot frame's action chunk (train.phase
    vla) is marked padded: it scores nothing and leaves the normaliser."""
    out = list(packs)
    for skip in skips:
        p = out[skip["row"]]
        start, end = skip["tokens"]
        labels = p["labels"].clone()
        labels[start:end] = -100
        out[skip["row"]] = {**p, "labels": labels, "num_loss_tokens": int((labels != -100).sum())}
        if "action_docs" in p:  # a robot frame whose camera image did not decode: its chunk scores nothing
            doc = int(torch.searchsorted(p["cu_seqlens"].to(torch.long), torch.tensor(start), right=True)) - 1
            pad = p["action_is_pad"].clone()
            pad[p["action_docs"] == doc] = True
            out[skip["row"]]["action_is_pad"] = pad
            out[skip["row"]]["num_action_values"] = int(((~pad).sum(1) * p["action_dims"]).sum())
        if "token_data" in p:
            out[skip["row"]]["token_data"] = {k: v.clone().index_fill_(0, torch.arange(start, end), 0)
                                              for k, v in p["token_data"].items()}
    return out
