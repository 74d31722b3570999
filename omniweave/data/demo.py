"""``omniweave data demo OUT``: a synthetic multimodal dataset that can only be solved by looking.

    OUT/train.jsonl   OpenAI-messages rows (user question, assistant one-word answer)
    OUT/eval.jsonl    held-out rows: the user turn only, plus ``answer`` and ``task``
    OUT/rl.jsonl      RL prompts of the visual tasks (user question + the answer as the assistant
                      turn): convert, pack with an RL recipe, reward by exact match
    OUT/dpo.jsonl     preference pairs (docs/dpo.md) in the OpenAI layout: the question, the correct
                      answer as the last assistant turn, a wrong answer of the same task as ``rejected``
    OUT/dpo_eval.jsonl  held-out pairs in the ShareGPT layout (``conversations`` + ``chosen`` / ``rejected``)
    OUT/kto.jsonl     KTO rows (``--kto-samples``; docs/dpo.md): the question and an answer, correct with
                      ``kto_tag: true`` for every other row, a wrong one of the task with ``kto_tag: false``
    OUT/media/        small PNG images, 4-frame MPEG-4 videos (and with ``--audio`` 16 kHz wav clips);
                      rows name them relative to it
    OUT/demo.json     what was generated (seed, counts per task, answer classes)

Tasks (answers from a small closed vocabulary, exactly balanced per task, wording independent of
the answer, so a model that ignores the pixels scores chance ~1/#classes):

    color       What colour is the shape?            red | green | blue | yellow
    shape       Which shape is it?                   circle | square | triangle
    position    Where is the shape?                  left | right | top | bottom
    count       How many shapes?                     1 | 2 | 3
    motion      (video) Which way does it move?      left | right | up | down
    which_red   (two images) Which has the red one?  first | second
    two_turns   colour, then shape of one image      (train only; multi-turn)
    add         text only: What is 3 plus 4?         0 .. 8
    copy        text only: Repeat the word: blue     the word

With ``--audio`` (opt-in: without it the output is unchanged) two listening tasks join the train
and eval splits, each a 1-1.5 s 16 kHz mono wav written with the ``wave`` module:

    pitch       (audio) Is the tone low, mid or high?  low | mid | high   (~220 / 550 / 1400 Hz)
    beeps       (audio) How many beeps are there?      1 | 2 | 3

Images are ``size``×``size`` pixels (default 56: one 28-px merged token per quadrant for
Qwen2-VL-style vision with patch 14, merge 2). Pack/train with ``min_pixels`` (and
``video_min_pixels``) at or below ``size**2`` so they are not upscaled.
"""

from __future__ import annotations

import argparse
import io
import json
import time
import wave
from fractions import Fraction
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

COLORS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (40, 70, 230), "yellow": (235, 215, 30)}
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("left", "right", "top", "bottom")
COUNTS = ("1", "2", "3")
DIRECTIONS = ("left", "right", "up", "down")
ORDINALS = ("first", "second")
WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon")
BACKGROUND = (110, 110, 110)

PITCHES = {"low": 220.0, "mid": 550.0, "high": 1400.0}  # Hz: a few mel bands apart at 128 bins
BEEPS = ("1", "2", "3")
AUDIO_RATE = 16000

CLASSES = {
    "color": tuple(COLORS), "shape": SHAPES, "position": POSITIONS, "count": COUNTS,
    "motion": DIRECTIONS, "which_red": ORDINALS, "two_turns": tuple(COLORS),
    "add": tuple(str(s) for s in range(9)), "copy": WORDS,
}
TRAIN_TASKS = ("color", "shape", "position", "count", "motion", "which_red", "two_turns", "add", "copy")
EVAL_TASKS = ("color", "shape", "position", "count", "motion", "which_red", "add")
RL_TASKS = ("color", "shape", "position", "count", "motion", "which_red")  # only solvable by looking
DPO_TASKS = (*RL_TASKS, "add")
AUDIO_CLASSES = {"pitch": tuple(PITCHES), "beeps": BEEPS}
AUDIO_TASKS = tuple(AUDIO_CLASSES)  # with --audio, in train and eval

QUESTIONS = {
    "color": ("What colour is the shape?", "Name the colour of the shape.", "Which colour does the shape have?"),
    "shape": ("Which shape is it?", "What kind of shape is shown?", "Name the shape."),
    "position": ("Where is the shape?", "In which part of the picture is the shape?", "Where does the shape sit?"),
    "count": ("How many shapes are there?", "Count the shapes.", "How many shapes do you see?"),
    "motion": ("Which way does the shape move?", "In which direction does the shape travel?"),
    "which_red": ("Which image has the red shape?", "In which image is the shape red?"),
    "pitch": ("Is the tone low, mid or high?", "How high is the tone?", "Name the pitch of the tone."),
    "beeps": ("How many beeps are there?", "Count the beeps.", "How many beeps do you hear?"),
}


# ---------------------------------------------------------------------------- drawing


def draw_shape(draw: ImageDraw.ImageDraw, kind: str, cx: float, cy: float, r: float, color) -> None:
    box = (cx - r, cy - r, cx + r, cy + r)
    if kind == "circle":
        draw.ellipse(box, fill=color)
    elif kind == "square":
        draw.rectangle(box, fill=color)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=color)


def render(shapes: list[tuple[str, float, float, float, tuple]], size: int) -> Image.Image:
    img = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for kind, cx, cy, r, color in shapes:
        draw_shape(draw, kind, cx * size, cy * size, r * size, color)
    return img


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False, compress_level=1)
    return buf.getvalue()


def mp4(frames: list[Image.Image], fps: int = 2) -> bytes:
    """MPEG-4 Part 2 (every PyAV wheel has the encoder) in an mp4 container, all frames kept."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = frames[0].width, frames[0].height, "yuv420p"
        stream.codec_context.gop_size = len(frames)
        stream.codec_context.bit_rate = 400_000
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_image(frame)):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def wav(samples: np.ndarray, rate: int = AUDIO_RATE) -> bytes:
    """16-bit PCM mono wav of float samples in [-1, 1] (the stdlib ``wave`` module)."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1.0, 1.0) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def tone(freq: float, seconds: float, rate: int = AUDIO_RATE, fade: float = 0.01) -> np.ndarray:
    """A sine with 10 ms linear fades (no clicks), amplitude 0.4."""
    t = np.arange(round(seconds * rate)) / rate
    ramp = np.clip(np.minimum(t, seconds - t) / fade, 0.0, 1.0)
    return 0.4 * np.sin(2 * np.pi * freq * t) * ramp


# ---------------------------------------------------------------------------- one sample per task


class Maker:
    """Draws the media and words of one sample; ``answer`` is chosen by the caller (balanced)."""

    def __init__(self, rng: np.random.Generator, media: Path, rel: str, size: int):
        self.rng, self.media, self.rel, self.size = rng, media, rel, size
        self.n = 0

    def save(self, data: bytes, ext: str) -> str:
        name = f"{self.rel}/{self.n:06d}.{ext}"
        self.n += 1
        (self.media / name).write_bytes(data)
        return name

    def pick(self, seq):
        return seq[int(self.rng.integers(len(seq)))]

    def jitter(self, amount: float = 0.06) -> float:
        return float(self.rng.uniform(-amount, amount))

    def one_shape(self, kind=None, color=None, where=(0.5, 0.5), r=0.2) -> str:
        kind = kind or self.pick(SHAPES)
        color = COLORS[color or self.pick(tuple(COLORS))]
        cx, cy = where[0] + self.jitter(), where[1] + self.jitter()
        return self.save(png(render([(kind, cx, cy, r, color)], self.size)), "png")

    def sound(self, task: str, answer: str) -> str:
        """A wav whose pitch (task ``pitch``) or number of beeps (``beeps``) is the answer, with a
        little noise and jittered frequency / timing so that only the named property is constant."""
        noise = lambda n: 0.01 * self.rng.standard_normal(n)  # noqa: E731
        if task == "pitch":
            clip = tone(PITCHES[answer] * float(self.rng.uniform(0.95, 1.05)), 1.0)
        else:
            clip = np.zeros(round(1.5 * AUDIO_RATE))
            freq = float(self.rng.uniform(500, 900))
            for slot in sorted(self.rng.permutation(3)[: int(answer)].tolist()):  # 3 slots of 0.5 s
                start = round((0.5 * slot + 0.1 + self.jitter(0.05)) * AUDIO_RATE)
                beep = tone(freq, 0.15)
                clip[start : start + len(beep)] += beep
        return self.save(wav(clip + noise(len(clip))), "wav")

    def make(self, task: str, answer: str) -> tuple[list[dict], list[str], list[str], list[str]]:
        """-> (messages incl. the assistant answer, images, videos, audios)."""
        q = self.pick(QUESTIONS[task]) if task in QUESTIONS else ""
        images: list[str] = []
        videos: list[str] = []
        audios: list[str] = []
        if task == "color":
            images = [self.one_shape(color=answer)]
        elif task == "shape":
            images = [self.one_shape(kind=answer)]
        elif task == "position":
            where = {"left": (0.25, 0.5), "right": (0.75, 0.5), "top": (0.5, 0.25), "bottom": (0.5, 0.75)}[answer]
            images = [self.one_shape(where=where, r=0.16)]
        elif task == "count":
            cells = self.rng.permutation(4)[: int(answer)]  # quadrants, one shape each
            shapes = [
                (self.pick(SHAPES), 0.25 + 0.5 * (c % 2) + self.jitter(0.04), 0.25 + 0.5 * (c // 2) + self.jitter(0.04),
                 0.13, COLORS[self.pick(tuple(COLORS))])
                for c in cells
            ]
            images = [self.save(png(render(shapes, self.size)), "png")]
        elif task == "motion":
            kind, color = self.pick(SHAPES), COLORS[self.pick(tuple(COLORS))]
            dx, dy = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}[answer]
            c0 = 0.5 + self.jitter(0.05)
            frames = []
            for t in np.linspace(-0.3, 0.3, 4):
                frames.append(render([(kind, c0 + dx * t if dx else c0, c0 + dy * t if dy else c0, 0.16, color)], self.size))
            videos = [self.save(mp4(frames), "mp4")]
        elif task == "which_red":
            other = self.pick(tuple(c for c in COLORS if c != "red"))
            colors = ("red", other) if answer == "first" else (other, "red")
            images = [self.one_shape(color=c) for c in colors]
        elif task == "two_turns":
            kind = self.pick(SHAPES)
            images = [self.one_shape(kind=kind, color=answer)]
            return [
                {"role": "user", "content": "<image>" + self.pick(QUESTIONS["color"])},
                {"role": "assistant", "content": answer},
                {"role": "user", "content": self.pick(QUESTIONS["shape"])},
                {"role": "assistant", "content": kind},
            ], images, videos, audios
        elif task == "add":
            s = int(answer)
            a = int(self.rng.integers(max(0, s - 4), min(4, s) + 1))
            q = f"What is {a} plus {s - a}?"
        elif task == "copy":
            q = f"Repeat the word: {answer}"
        elif task in AUDIO_CLASSES:
            audios = [self.sound(task, answer)]
        else:
            raise ValueError(f"unknown demo task {task!r}")
        if task == "which_red":
            prompt = f"First image: <image> Second image: <image> {q}"
        else:
            prompt = "<image>" * len(images) + "<video>" * len(videos) + "<audio>" * len(audios) + q
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}], images, videos, audios


def _balanced(tasks: tuple[str, ...], n: int, rng: np.random.Generator) -> list[tuple[str, str]]:
    """n (task, answer) pairs: tasks round-robin, each task's answers cycling over its classes."""
    seen = {t: 0 for t in tasks}
    pairs = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        classes = CLASSES.get(task) or AUDIO_CLASSES[task]
        pairs.append((task, classes[seen[task] % len(classes)]))
        seen[task] += 1
    order = rng.permutation(n)
    return [pairs[i] for i in order]


def preference_row(row: dict, task: str, answer: str, rng: np.random.Generator, layout: str) -> dict:
    """A demo row as a preference pair: its answer chosen, another answer of the task rejected."""
    wrong = str(rng.choice([c for c in CLASSES[task] if c != answer]))
    messages = row["messages"]
    if layout == "openai":
        return {**row, "rejected": {"role": "assistant", "content": wrong}}
    turns = [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in messages[:-1]]
    return {"id": row["id"], "conversations": turns, "chosen": {"from": "gpt", "value": answer},
            "rejected": {"from": "gpt", "value": wrong}, "images": row["images"], "videos": row["videos"]}


def kto_row(row: dict, task: str, answer: str, rng: np.random.Generator, desirable: bool) -> dict:
    """A demo row as a KTO completion: its answer (desirable) or another answer of the task (not)."""
    if desirable:
        return {**row, "kto_tag": True}
    wrong = str(rng.choice([c for c in CLASSES[task] if c != answer]))
    return {**row, "messages": [*row["messages"][:-1], {"role": "assistant", "content": wrong}], "kto_tag": False}


def generate(out_dir: str | Path, samples: int = 1000, eval_samples: int = 200, seed: int = 0, size: int = 56,
             rl_samples: int = 0, audio: bool = False, dpo_samples: int = 0, kto_samples: int = 0) -> dict:
    """Write the demo dataset to ``out_dir``; returns a summary (also saved as ``demo.json``).
    ``audio``: add the listening tasks (``AUDIO_TASKS``) to train and eval. ``dpo_samples``:
    preference pairs (``dpo.jsonl``, and ``eval_samples`` held-out ones in ``dpo_eval.jsonl``);
    ``kto_samples``: KTO completions (``kto.jsonl``), half of them desirable."""
    out = Path(out_dir)
    summary = {"seed": seed, "size": size, "train": samples, "eval": eval_samples, "rl": rl_samples,
               "classes": {**CLASSES, **(AUDIO_CLASSES if audio else {})}, **({"audio": True} if audio else {}),
               **({"dpo": dpo_samples} if dpo_samples else {}), **({"kto": kto_samples} if kto_samples else {})}
    extra = AUDIO_TASKS if audio else ()
    splits = [("train", samples, TRAIN_TASKS + extra, 0), ("eval", eval_samples, EVAL_TASKS + extra, 1)]
    if rl_samples:
        splits.append(("rl", rl_samples, RL_TASKS, 2))
    if dpo_samples:
        splits += [("dpo", dpo_samples, DPO_TASKS, 3), ("dpo_eval", eval_samples, DPO_TASKS, 4)]
    if kto_samples:
        splits.append(("kto", kto_samples, DPO_TASKS, 5))
    for split, n, tasks, sub_seed in splits:
        rng = np.random.default_rng([seed, sub_seed])
        (out / "media" / split).mkdir(parents=True, exist_ok=True)
        maker = Maker(rng, out / "media", split, size)
        counts: dict[str, int] = {}
        with open(out / f"{split}.jsonl", "w") as f:
            for i, (task, answer) in enumerate(_balanced(tasks, n, rng)):
                messages, images, videos, audios = maker.make(task, answer)
                row = {"id": f"{split}-{i:06d}", "messages": messages, "images": images, "videos": videos,
                       **({"audios": audios} if audios else {})}
                if split == "eval":
                    row = {**row, "messages": messages[:-1], "answer": answer, "task": task}
                elif split.startswith("dpo"):
                    row = preference_row(row, task, answer, rng, "openai" if split == "dpo" else "sharegpt")
                elif split == "kto":
                    row = kto_row(row, task, answer, rng, desirable=i % 2 == 0)
                f.write(json.dumps(row) + "\n")
                counts[task] = counts.get(task, 0) + 1
        summary[f"{split}_tasks"] = counts
    (out / "demo.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="output directory")
    p.add_argument("--samples", type=int, default=1000, help="training rows")
    p.add_argument("--eval-samples", type=int, default=200, help="held-out rows (with answer and task)")
    p.add_argument("--rl-samples", type=int, default=1000, help="RL prompt rows (rl.jsonl; 0: none)")
    p.add_argument("--dpo-samples", type=int, default=1000,
                   help="preference pairs (dpo.jsonl, plus --eval-samples held-out ones in dpo_eval.jsonl; 0: none)")
    p.add_argument("--kto-samples", type=int, default=0, help="KTO completions, half desirable (kto.jsonl; 0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", type=int, default=56, help="image / video side in pixels")
    p.add_argument("--audio", action="store_true",
                   help="add the listening tasks pitch / beeps (wav clips) to train and eval; pack them with a "
                   "recipe whose model has an audio_encoder")


def run(args) -> int:
    t0 = time.perf_counter()
    s = generate(args.out, samples=args.samples, eval_samples=args.eval_samples, seed=args.seed, size=args.size,
                 rl_samples=args.rl_samples, audio=args.audio, dpo_samples=args.dpo_samples, kto_samples=args.kto_samples)
    kto = f" + {s['kto']} KTO completions" if s.get("kto") else ""
    print(
        f"demo: {s['train']} train + {s['eval']} eval + {s['rl']} RL rows + {s.get('dpo', 0)} preference pairs{kto}, "
        f"{len(s['train_tasks'])} tasks, "
        f"{args.size}px media{' + wav clips' if args.audio else ''} in {time.perf_counter() - t0:.1f}s -> {args.out}"
    )
    return 0
