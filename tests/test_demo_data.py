"""The synthetic demo dataset: deterministic, balanced answers, wording that does not leak the
answer, pixels that do hold it, and fast enough to generate in the demo."""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict

import numpy as np
import pytest
from PIL import Image

from omniweave.data.demo import BACKGROUND, CLASSES, COLORS, EVAL_TASKS, TRAIN_TASKS, generate
from omniweave.data.media.vision import probe_video


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    t0 = time.perf_counter()
    summary = generate(root, samples=1000, eval_samples=140, seed=0)
    seconds = time.perf_counter() - t0
    train = [json.loads(x) for x in (root / "train.jsonl").read_text().splitlines()]
    evals = [json.loads(x) for x in (root / "eval.jsonl").read_text().splitlines()]
    return root, summary, seconds, train, evals


def task_of(row):
    return row.get("task") or row["id"]


def test_thousand_samples_generate_in_seconds(demo):
    _, summary, seconds, train, evals = demo
    assert len(train) == 1000 and len(evals) == 140
    assert seconds < 10, f"1000 demo samples took {seconds:.1f}s"
    assert set(summary["train_tasks"]) == set(TRAIN_TASKS) and set(summary["eval_tasks"]) == set(EVAL_TASKS)


def test_eval_answers_are_balanced_per_task(demo):
    evals = demo[4]
    by_task = defaultdict(Counter)
    for row in evals:
        by_task[row["task"]][row["answer"]] += 1
        assert [m["role"] for m in row["messages"]] == ["user"]  # the prompt only
    for task, counts in by_task.items():
        assert set(counts) == set(CLASSES[task]), task
        assert max(counts.values()) - min(counts.values()) <= 1, (task, counts)


def test_train_answers_are_balanced_and_wording_does_not_leak(demo):
    train = demo[3]
    answers = Counter(row["messages"][1]["content"] for row in train if "Which colour" in row["messages"][0]["content"])
    assert set(answers) <= set(COLORS)
    # every visual question wording is asked with several different answers
    answers_per_prompt = defaultdict(set)
    for row in train:
        if row["images"] or row["videos"]:
            answers_per_prompt[row["messages"][0]["content"]].add(row["messages"][1]["content"])
    assert all(len(a) >= 2 for a in answers_per_prompt.values()), answers_per_prompt
    classes = Counter(row["messages"][-1]["content"] for row in train)
    assert classes["first"] and classes["second"] and abs(classes["first"] - classes["second"]) <= 1


def test_media_match_placeholders_and_sizes(demo):
    root, _, _, train, _ = demo
    kinds = Counter()
    for row in train:
        text = "".join(m["content"] for m in row["messages"])
        assert text.count("<image>") == len(row["images"]) and text.count("<video>") == len(row["videos"])
        kinds["text" if not row["images"] and not row["videos"] else "video" if row["videos"] else "image"] += 1
        if len(row["messages"]) == 4:
            kinds["multi_turn"] += 1
        if len(row["images"]) == 2:
            kinds["multi_image"] += 1
    assert all(kinds[k] > 50 for k in ("text", "image", "video", "multi_turn", "multi_image")), kinds
    img = Image.open(root / "media" / train[0]["images"][0]) if train[0]["images"] else None
    video = next(r for r in train if r["videos"])["videos"][0]
    info = probe_video((root / "media" / video).read_bytes())
    assert (info.num_frames, info.height, info.width) == (4, 56, 56)
    if img is not None:
        assert img.size == (56, 56)


def foreground(path):
    px = np.asarray(Image.open(path).convert("RGB")).astype(int)
    mask = np.abs(px - np.asarray(BACKGROUND)).sum(-1) > 60
    return px, mask


def test_pixels_hold_the_answer(demo):
    """An oracle that looks at the pixels answers colour, position and motion rows correctly."""
    root, _, _, _, evals = demo
    checked = Counter()
    for row in evals:
        if row["task"] == "color":
            px, mask = foreground(root / "media" / row["images"][0])
            mean = px[mask].mean(0)
            guess = min(COLORS, key=lambda c: np.abs(mean - COLORS[c]).sum())
        elif row["task"] == "position":
            _, mask = foreground(root / "media" / row["images"][0])
            ys, xs = np.nonzero(mask)
            dx, dy = xs.mean() - 27.5, ys.mean() - 27.5
            guess = (("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("bottom" if dy > 0 else "top"))
        elif row["task"] == "motion":
            import av
            import io

            with av.open(io.BytesIO((root / "media" / row["videos"][0]).read_bytes())) as c:
                frames = [f.to_ndarray(format="rgb24").astype(int) for f in c.decode(video=0)]
            centers = []
            for f in (frames[0], frames[-1]):
                ys, xs = np.nonzero(np.abs(f - np.asarray(BACKGROUND)).sum(-1) > 90)
                centers.append((xs.mean(), ys.mean()))
            dx, dy = centers[1][0] - centers[0][0], centers[1][1] - centers[0][1]
            guess = (("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up"))
        else:
            continue
        assert guess == row["answer"], row
        checked[row["task"]] += 1
    assert min(checked.values()) >= 15, checked


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = generate(tmp_path / "a", samples=30, eval_samples=10, seed=5)
    b = generate(tmp_path / "b", samples=30, eval_samples=10, seed=5)
    generate(tmp_path / "c", samples=30, eval_samples=10, seed=6)
    assert a == b
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()
        assert (tmp_path / "a" / name).read_text() != (tmp_path / "c" / name).read_text()
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a/media").rglob("*.*"))
    assert files and all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
