"""Generation evaluation: greedy decoding batched over prompts, exact-match accuracy.

The eval split is a JSONL file of OpenAI-messages rows (``messages``, ``images``, ``videos``,
``audios`` relative to a media directory) that also carry the expected ``answer`` and a ``task`` name, as
``omniweave data demo`` writes it. Each row's trailing assistant turn (if any) is removed, the
assistant header is appended, and the model continues greedily until a stop token::

    report = evaluate_file(model, SampleProcessor(cfg.data), "demo/eval.jsonl", "demo/media")
    report["accuracy"], report["by_task"]["color"]

Decoding goes through the one KV-cache generation path, the RL rollout engine
(:class:`omniweave.generation.TorchRollout`, temperature 0, one sample per prompt): ``batch_size``
prompts are packed into one row, their media encoded once, the row prefilled once, and the
prompts decoded in lockstep. A prompt's tokens do not depend on which prompts share its batch
(up to floating-point rounding).

From a recipe, the trainer calls :func:`eval_fn` every ``train.eval_interval`` steps and at the
end (recipe section ``eval: {path, media_dir, max_samples, max_new_tokens, batch_size}``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from omniweave.data.loading.loader import media_batch
from omniweave.data.sample import Conversation, Message, RawSample, TokenizedSample
from omniweave.data.text.tokenize import SampleProcessor, SampleRejected
from omniweave.generation import Prompt, SamplingParams, TorchRollout

_ROLE_ALIASES = {"human": "user", "gpt": "assistant"}


def read_eval_rows(path: str | Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{line_no}: not JSON ({e})") from e
    return rows


def row_to_raw(row: dict[str, Any], media_dir: str | Path, index: int) -> RawSample:
    """An eval row as a RawSample whose media parts hold the files' bytes."""
    if "answer" not in row:
        raise ValueError(f"eval row {index} has no 'answer' field")
    turns = row.get("messages") or row.get("conversations") or []
    messages = []
    for t in turns:
        role = t.get("role", t.get("from"))
        content = t.get("content", t.get("value"))
        messages.append(Message(_ROLE_ALIASES.get(role, role), content))
    media: dict[str, bytes] = {}
    parts: dict[str, list[str]] = {"images": [], "videos": [], "audios": []}
    for key, prefix in (("images", "img"), ("videos", "vid"), ("audios", "aud")):
        for i, rel in enumerate(row.get(key) or []):
            path = Path(media_dir) / rel
            name = f"{prefix}{i}{path.suffix.lower()}"
            media[name] = path.read_bytes()
            parts[key].append(name)
    conv = Conversation(str(row.get("id", index)), messages, parts["images"], parts["videos"], parts["audios"])
    return RawSample(key=f"eval{index}", conversation=conv, media=media)


def prompt_batch(processor: SampleProcessor, raw: RawSample) -> dict:
    """The model batch of one generation prompt (the micro-batch contract, one document; on the
    CPU: the rollout engine packs prompts there and moves the row to the model's device)."""
    sample: TokenizedSample = processor.tokenize_prompt(raw)
    length = len(sample)
    return {
        "input_ids": torch.as_tensor(sample.input_ids, dtype=torch.long),
        "labels": torch.full((length,), -100, dtype=torch.long),
        "position_ids": torch.as_tensor(sample.position_ids, dtype=torch.long),
        "cu_seqlens": torch.tensor([0, length], dtype=torch.int32),
        **media_batch(processor, [(span, raw.media[span.part]) for span in sample.media]),
        "num_loss_tokens": 0,
    }


def normalize_answer(text: str) -> str:
    return " ".join(text.strip().lower().rstrip(".!").split())


@torch.no_grad()
def evaluate_rows(
    model: torch.nn.Module,
    processor: SampleProcessor,
    rows: Iterable[dict[str, Any]],
    media_dir: str | Path,
    max_new_tokens: int = 8,
    batch_size: int = 16,
    examples: int = 5,
) -> dict[str, Any]:
    """Greedy-decode every row, ``batch_size`` prompts at a time, and compare with its ``answer``
    (case- and space-insensitive). Rows the processor rejects are counted in ``skipped`` by reason."""
    if batch_size < 1:
        raise ValueError(f"eval batch_size must be >= 1, got {batch_size}")
    eos_ids = tuple(processor.tokenizer.token_id(t) for t in processor.template.stop_tokens)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_ids=eos_ids)
    engine = TorchRollout(model)
    hits: dict[str, list[int]] = defaultdict(list)
    shown, skipped = [], defaultdict(int)
    pending: list[tuple[dict[str, Any], Prompt]] = []

    def decode_pending() -> None:
        rollouts = engine.generate([p for _, p in pending], group_size=1, params=params, seed=0)
        for (row, _), r in zip(pending, rollouts):
            prediction = processor.tokenizer.decode([t for t in r.tokens if t not in eos_ids])
            ok = normalize_answer(prediction) == normalize_answer(str(row["answer"]))
            hits[str(row.get("task", "all"))].append(int(ok))
            if len(shown) < examples:
                shown.append({"task": row.get("task"), "answer": row["answer"], "prediction": prediction})
        pending.clear()

    was_training = model.training
    model.eval()
    try:
        for i, row in enumerate(rows):
            raw = row_to_raw(row, media_dir, i)
            try:
                pending.append((row, Prompt(uid=i, batch=prompt_batch(processor, raw))))
            except SampleRejected as e:
                skipped[e.reason] += 1
                continue
            if len(pending) == batch_size:
                decode_pending()
        if pending:
            decode_pending()
    finally:
        model.train(was_training)
    total = [h for task in hits.values() for h in task]
    return {
        "accuracy": float(np.mean(total)) if total else 0.0,
        "n": len(total),
        "by_task": {task: float(np.mean(v)) for task, v in sorted(hits.items())},
        "skipped": dict(skipped),
        "examples": shown,
    }


def evaluate_file(model, processor, path, media_dir, max_samples: int | None = None, **kw) -> dict[str, Any]:
    rows = read_eval_rows(path)
    return evaluate_rows(model, processor, rows[:max_samples] if max_samples else rows, media_dir, **kw)


def eval_fn(model: torch.nn.Module, cfg, step: int) -> dict[str, float]:
    """Trainer hook (``train.eval_fn: omniweave.train.evaluate.eval_fn``): accuracy on ``cfg.eval``."""
    from omniweave.config import section

    ev = section(cfg, "eval")
    report = evaluate_file(
        model,
        SampleProcessor(cfg["data"]),
        ev.path,
        ev.media_dir or Path(ev.path).parent / "media",
        max_samples=ev.max_samples,
        max_new_tokens=ev.max_new_tokens,
        batch_size=ev.batch_size,
    )
    out = {"eval_accuracy": report["accuracy"], "eval_n": report["n"]}
    out.update({f"eval_accuracy/{task}": acc for task, acc in report["by_task"].items()})
    return out
