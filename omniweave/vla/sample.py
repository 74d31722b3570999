"""``omniweave vla sample RUN --frames RAW``: a trained VLA's action chunks for recorded frames.

    omniweave vla sample runs/demo_vla/run --frames runs/demo_vla/raw --count 64 --output chunks.jsonl

For each of the first ``--count`` frames of a LeRobot conversion (``data convert --format
lerobot``) the policy (vla/policy.py) sees the frame's camera images, state and task and returns
an action chunk; each line of ``--output`` holds the frame's index, the chunk and the recorded one.
The summary line gives the mean squared error against the recorded chunks over their real
(unpadded) steps, in the dataset's units and normalised (the quantile scale the loss uses), and
the policy's latency. Frames the policy cannot read (a camera missing, a frame that does not
decode) are counted and named, not skipped silently.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

import numpy as np


def add_arguments(p: argparse.ArgumentParser) -> None:
    from omniweave.argtypes import integer

    p.add_argument("run", help="a VLA run directory (its latest checkpoint) or a checkpoint directory")
    p.add_argument("--frames", required=True, help="a LeRobot conversion (omniweave data convert --format lerobot)")
    p.add_argument("--count", type=integer(1), default=32, help="frames to sample, from the first (default 32)")
    p.add_argument("--batch", type=integer(1), default=16, help="observations per policy call (one packed row)")
    p.add_argument("--steps", type=integer(1), default=None, help="Euler steps (default: the expert's num_steps)")
    p.add_argument("--stats", default=None, help="lerobot_stats.json (default: the run's packed dataset's)")
    p.add_argument("--seed", type=int, default=0, help="the sampling noise's seed")
    p.add_argument("--output", default=None, help="JSONL of the chunks (default: none, summary only)")


def _frame_observation(raw, i: int, cameras: list[str], reader) -> tuple[dict, dict]:
    """(observation for the policy, the recorded frame) of raw sample ``i``; ``reader``: the
    command's FrameReader (data/packing/video_frames.py), which reads frames in order without a seek each."""
    from PIL import Image

    from omniweave.data.sources.shards import parse_sample_bytes

    _, parts = parse_sample_bytes(raw.read_bytes(i))
    frame = json.loads(parts["vla.json"])
    images = {}
    for camera in cameras:
        ref = frame["cameras"][camera]
        png = reader.png(Path(raw.root) / ref["file"], float(ref["timestamp"]))
        images[camera] = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    return {"images": images, "state": np.asarray(frame["state"]), "task": frame["task"]}, frame


def run(args) -> int:
    from omniweave.data.packing.video_frames import FrameReader
    from omniweave.data.sources.lerobot import normalize
    from omniweave.data.sources.shards import RawDataset
    from omniweave.data.text.tokenize import SampleRejected
    from omniweave.vla.policy import Policy

    policy = Policy.load(args.run, stats=args.stats, seed=args.seed)
    raw = RawDataset(args.frames)
    count = min(args.count, len(raw))
    observations, frames, unreadable = [], [], {}
    reader = FrameReader()
    try:
        for i in range(count):
            try:
                obs, frame = _frame_observation(raw, i, policy.cameras, reader)
            except (KeyError, SampleRejected) as e:
                unreadable[i] = f"{type(e).__name__}: {e}"
                continue
            observations.append(obs)
            frames.append(frame)
    finally:
        reader.close()
    chunks, seconds = [], []
    for start in range(0, len(observations), args.batch):
        t0 = time.perf_counter()
        chunks += policy.sample(observations[start:start + args.batch], args.steps)
        seconds.append(time.perf_counter() - t0)
    errors, normalised = [], []
    out = open(args.output, "w") if args.output else None
    try:
        for frame, chunk in zip(frames, chunks):
            keep = ~np.asarray(frame["action_is_pad"], bool)
            recorded = np.asarray(frame["actions"], np.float64)
            errors.append(((chunk - recorded)[keep] ** 2).mean())
            stats = policy.stats["action"]
            normalised.append(((normalize(chunk, stats) - normalize(recorded, stats))[keep] ** 2).mean())
            if out is not None:
                out.write(json.dumps({"index": frame["index"], "task": frame["task"], "chunk": chunk.tolist(),
                                      "recorded": frame["actions"], "action_is_pad": frame["action_is_pad"]}) + "\n")
    finally:
        if out is not None:
            out.close()
    for i, why in unreadable.items():
        print(f"frame {i}: not sampled ({why})", file=sys.stderr)
    if not chunks:
        print(f"vla sample: no frame of {count} could be read", file=sys.stderr)
        return 1
    print(f"vla sample: {len(chunks)} chunks of {policy.horizon} actions ({len(unreadable)} frames unreadable); "
          f"MSE vs recorded {np.mean(errors):.6g} (normalised {np.mean(normalised):.4g}); "
          f"{1000 * np.median(seconds):.1f} ms median per call of up to {args.batch} observations"
          + (f" -> {args.output}" if args.output else ""))
    return 0
