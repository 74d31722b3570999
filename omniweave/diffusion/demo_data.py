"""Synthetic text-to-video clips of the diffusion demo: a coloured shape moving in a described direction.

A clip is one integer seed (>= 0). Its (colour, direction) *combination* is arithmetic, so that any
run of 16 consecutive seeds holds every combination once::

    colour    = COLOURS[seed % 4]            red | green | blue | white  (any two differ in two channels)
    direction = DIRECTIONS[seed // 4 % 4]    left | right | up | down

and the rest comes from ``np.random.default_rng(seed)``: the shape (disc or square), the position
across the motion, the distance travelled (``TRAVEL`` x the room the frame leaves, so the motion is
always clearly visible: >= 10 px, about the shape's width, in a 32 x 48 clip) and the start, chosen
so that the whole shape (anti-aliased edge included) stays ``MARGIN`` px inside the frame in every
frame. The speed in px / frame is that distance over ``frames - 1``. The shape's colour is exact (no
jitter) on a uniform dark ``BACKGROUND``; its radius (half side for a square) is ``RADIUS`` x
min(H, W). Caption: ``caption(colour, direction, shape)`` = "a red disc moving left", nothing else varies.

Sizes follow the Wan VAE and DiT: ``frames`` = 4k + 1 (k >= 1; 1 + 4 latent frames per 16 video
frames), H and W multiples of 16 (8x VAE downsampling, then 2x2 patches). Default 17 x 32 x 48.

``write_clips_dataset(OUT, n)`` writes::

    OUT/train.jsonl            {"id", "video", "caption", "colour", "direction", "shape", "seed"}
    OUT/heldout_prompts.jsonl  {"id", "prompt", "colour", "direction", "shape", "seed"}
    OUT/videos/<id>.mp4        the clip, ``FPS`` frames/s (rows name it relative to OUT)
    OUT/demo.json              what was written (sizes, fps, codec, held-out combinations, counts)

Training clip i is the i-th seed from ``seed`` on whose combination is not held out (12 of every
16 seeds by default: the held-out combinations ``HELD_OUT`` never appear in training, while every
colour and every direction still does, so the held-out prompts ask for compositional
generalisation). A held-out prompt's ``seed`` is the next unused seed of its combination:
``render_clip(seed)`` is a real clip of that prompt (a reference for the checker, never trained on).

Videos are H.264 (libx264, crf 0, yuv444p: lossless in luma, full chroma, so the decoded frames
equal the rendered ones but for YUV rounding); a PyAV build without libx264 gets MPEG-4 Part 2 at
its finest quantiser (q 1, intra only, yuv420p), which the checker still reads.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from tqdm import tqdm

# Pure primaries and white: any two differ in two of the three channels (red and yellow, the earlier
# fourth colour, differ in one: a tiny VAE's reconstructions of red drifted to orange, read as yellow;
# with this palette a 1500-step fit reconstructs 100 % of unseen clips readably, docs/diffusion.md).
COLOURS = {"red": (230, 30, 30), "green": (30, 210, 30), "blue": (40, 60, 240), "white": (225, 225, 225)}
DIRECTIONS = ("left", "right", "up", "down")
SHAPES = ("disc", "square")
BACKGROUND = (16, 16, 16)
HELD_OUT = (("red", "left"), ("green", "right"), ("blue", "up"), ("white", "down"))  # one per colour and direction
RADIUS = 0.15  # x min(H, W)
MARGIN = 1.0  # px between the shape's anti-aliased edge and the frame border
TRAVEL = (0.55, 1.0)  # distance moved, as a fraction of the room the frame leaves along the motion
FPS = 16  # Wan's
FRAMES, HEIGHT, WIDTH = 17, 32, 48
_STEP = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}  # (dx, dy), y down


def caption(colour: str, direction: str, shape: str = "disc") -> str:
    return f"a {colour} {shape} moving {direction}"


def check_size(frames: int, height: int, width: int) -> None:
    """ValueError unless frames = 4k + 1 (k >= 1) and H, W are positive multiples of 16 (Wan VAE + DiT)."""
    if frames < 5 or (frames - 1) % 4:
        raise ValueError(f"frames must be 4k + 1 with k >= 1 (5, 9, 13, 17, ...) for the Wan VAE, got {frames}")
    for name, size in (("height", height), ("width", width)):
        if size < 16 or size % 16:
            raise ValueError(f"{name} must be a positive multiple of 16 (VAE 8x, DiT patch 2), got {size}")


def combination(seed: int) -> tuple[str, str]:
    """(colour, direction) of clip ``seed``."""
    return tuple(COLOURS)[seed % 4], DIRECTIONS[seed // 4 % 4]


def clip_spec(seed: int, frames: int = FRAMES, height: int = HEIGHT, width: int = WIDTH) -> dict:
    """Everything that clip ``seed`` draws: colour, direction, shape, radius, start (x, y) and speed
    (px / frame) in pixel units (pixel (i, j) is centred on x = j + 0.5, y = i + 0.5), caption."""
    check_size(frames, height, width)
    if int(seed) != seed or seed < 0:
        raise ValueError(f"a clip seed is an integer >= 0, got {seed!r}")
    seed = int(seed)
    colour, direction = combination(seed)
    rng = np.random.default_rng(seed)
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    radius = RADIUS * min(height, width)
    low = radius + 0.5 + MARGIN  # the lowest centre coordinate that keeps the edge inside
    dx, dy = _STEP[direction]
    along, across = (width, height) if dx else (height, width)
    room = along - 2 * low
    travel = float(rng.uniform(*TRAVEL)) * room
    start = float(rng.uniform(low, low + room - travel))  # the lower end of the path
    if dx < 0 or dy < 0:  # moving towards 0: start at the upper end
        start += travel
    other = float(rng.uniform(low, across - low))
    x, y = (start, other) if dx else (other, start)
    return {"seed": seed, "colour": colour, "direction": direction, "shape": shape, "radius": radius,
            "start": (x, y), "speed": travel / (frames - 1), "caption": caption(colour, direction, shape)}


def render_clip(seed: int, frames: int = FRAMES, height: int = HEIGHT, width: int = WIDTH) -> np.ndarray:
    """Clip ``seed`` as uint8 [frames, height, width, 3] (anti-aliased edge, exact colour inside)."""
    spec = clip_spec(seed, frames, height, width)
    dx, dy = _STEP[spec["direction"]]
    t = np.arange(frames, dtype=np.float64)[:, None, None]
    cx = spec["start"][0] + dx * spec["speed"] * t
    cy = spec["start"][1] + dy * spec["speed"] * t
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float64) + 0.5
    r = spec["radius"]
    if spec["shape"] == "disc":
        cover = np.clip(r + 0.5 - np.hypot(xs - cx, ys - cy), 0.0, 1.0)
    else:
        cover = np.clip(r + 0.5 - np.abs(xs - cx), 0.0, 1.0) * np.clip(r + 0.5 - np.abs(ys - cy), 0.0, 1.0)
    bg, fg = np.array(BACKGROUND, np.float64), np.array(COLOURS[spec["colour"]], np.float64)
    return np.rint(bg + cover[..., None] * (fg - bg)).astype(np.uint8)


def video_codec() -> str:
    """libx264 where this PyAV build has the encoder, else mpeg4 (every build has it)."""
    return "libx264" if "libx264" in av.codecs_available else "mpeg4"


def write_mp4(path: str | Path, frames: np.ndarray, fps: int = FPS, codec: str | None = None) -> None:
    """uint8 [T, H, W, 3] (H, W even) as an MP4, frame i at pts i (time base 1 / fps)."""
    codec = codec or video_codec()
    with av.open(str(path), mode="w", format="mp4") as out:
        stream = out.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))  # 23.976 -> 24000/1001
        stream.height, stream.width = frames.shape[1:3]
        if codec == "libx264":
            stream.pix_fmt, stream.options = "yuv444p", {"crf": "0"}
        else:
            stream.pix_fmt, stream.bit_rate = "yuv420p", 8_000_000  # the finest quantiser: qmin = qmax = 1
            stream.options = {"qmin": "1", "qmax": "1", "g": "1"}
        for image in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def read_mp4(path: str | Path) -> np.ndarray:
    """Every frame of a video as uint8 [T, H, W, 3] RGB."""
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def _held_out(held_out: Sequence[Sequence[str]] | None) -> set[tuple[str, str]]:
    pairs = {(str(c), str(d)) for c, d in (HELD_OUT if held_out is None else held_out)}
    bad = sorted(p for p in pairs if p[0] not in COLOURS or p[1] not in DIRECTIONS)
    if bad:
        raise ValueError(f"held_out names unknown combinations {bad}: colours {list(COLOURS)}, "
                         f"directions {list(DIRECTIONS)}")
    if len(pairs) >= len(COLOURS) * len(DIRECTIONS):
        raise ValueError("held_out leaves no combination to train on")
    return pairs


def write_clips_dataset(out_dir: str | Path, num_clips: int, seed: int = 0, frames: int = FRAMES,
                        height: int = HEIGHT, width: int = WIDTH, held_out: Sequence[Sequence[str]] | None = None,
                        heldout_per_combination: int = 4, progress: bool = True) -> Path:
    """Write ``num_clips`` training clips and the held-out prompts under ``out_dir`` (see the module
    docstring); ``held_out`` = (colour, direction) pairs kept out of training (None: ``HELD_OUT``,
    ``()``: none). Returns the path of ``train.jsonl``. Deterministic given the arguments."""
    check_size(frames, height, width)
    if num_clips < 1 or seed < 0 or heldout_per_combination < 0:
        raise ValueError(f"num_clips >= 1, seed >= 0, heldout_per_combination >= 0; got {num_clips}, {seed}, "
                         f"{heldout_per_combination}")
    held = _held_out(held_out)
    out = Path(out_dir)
    (out / "videos").mkdir(parents=True, exist_ok=True)
    codec, rows, clip_seed = video_codec(), [], seed
    with tqdm(total=num_clips, desc="diffusion demo clips", unit="clip", disable=not progress) as bar:
        while len(rows) < num_clips:
            if combination(clip_seed) not in held:
                spec = clip_spec(clip_seed, frames, height, width)
                clip_id = f"clip_{len(rows):06d}"
                write_mp4(out / "videos" / f"{clip_id}.mp4", render_clip(clip_seed, frames, height, width), codec=codec)
                rows.append({"id": clip_id, "video": f"videos/{clip_id}.mp4", "caption": spec["caption"],
                             "colour": spec["colour"], "direction": spec["direction"], "shape": spec["shape"],
                             "seed": clip_seed})
                bar.update()
            clip_seed += 1
    prompts = []
    for colour, direction in sorted(held, key=lambda p: (tuple(COLOURS).index(p[0]), DIRECTIONS.index(p[1]))):
        s = clip_seed + (tuple(COLOURS).index(colour) - clip_seed) % 4  # the next seed of this colour ...
        s += 4 * ((DIRECTIONS.index(direction) - s // 4) % 4)  # ... and direction (16 apart from here)
        for k in range(heldout_per_combination):
            spec = clip_spec(s + 16 * k, frames, height, width)
            prompts.append({"id": f"heldout_{len(prompts):04d}", "prompt": spec["caption"], "colour": colour,
                            "direction": direction, "shape": spec["shape"], "seed": spec["seed"]})
    train = out / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "heldout_prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    (out / "demo.json").write_text(json.dumps({
        "frames": frames, "height": height, "width": width, "fps": FPS, "codec": codec, "seed": seed,
        "train_clips": len(rows), "heldout_prompts": len(prompts), "colours": COLOURS, "directions": DIRECTIONS,
        "held_out": sorted(held)}, indent=1) + "\n")
    return train
