"""Benchmark: reading LeRobot camera frames for packing, a forward-moving cursor per video file
(``data/packing/video_frames.FrameReader``, what ``data pack`` uses) vs a fresh seek per frame (what
it did before; ``decode_frame_png``, which ``vla sample`` still uses for a few frames).

Data: ``write_reach_dataset(--episodes, image_size=--size, layout="ring")`` (the VLA demo's
simulator) with each video's keyframe interval set to each --gop (H.264, lossless luma), then
``data convert --format lerobot``. Per GOP: the camera references of the first --frames samples,
read in sample order (as packing reads them) by both arms, --repeats times alternating; the PNG
bytes must be identical. Figures: median seconds per arm, frames/s, ratio = seek / cursor.

    python bench/vla_frames.py [--quick] [--episodes 200] [--size 96] [--gop 1 30 250]
        [--frames 600] [--repeats 3] [--work DIR] [--out bench/out]

Prints a markdown table and writes vla_frames.png / .json / .md under --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: omniweave, bench
from bench.figure import pyplot, save, write_results  # noqa: E402
from bench.quick import HELP as QUICK_HELP, note, work_dir  # noqa: E402


def make_raw(work: Path, args, gop: int) -> Path:
    from omniweave.cli import main as cli
    from omniweave.data.sources import lerobot_write
    from omniweave.vla.demo_data import write_reach_dataset

    raw = work / f"gop{gop}" / "raw"
    if not raw.exists():
        plain = lerobot_write.write_video
        lerobot_write.write_video = functools.partial(plain, gop=gop)
        try:
            write_reach_dataset(raw.parent / "dataset", episodes=args.episodes, seed=0, image_size=args.size,
                                layout="ring")
        finally:
            lerobot_write.write_video = plain
        assert cli(["data", "convert", "--format", "lerobot", "--input", str(raw.parent / "dataset"), "--output",
                    str(raw), "--horizon", "4", "--no-progress"]) == 0
    return raw


def camera_refs(raw: Path, n: int) -> list[tuple[Path, float]]:
    from omniweave.data.sources.shards import RawDataset, parse_sample_bytes

    ds = RawDataset(raw)
    refs = []
    for i in range(min(n, len(ds))):
        frame = json.loads(parse_sample_bytes(ds.read_bytes(i))[1]["vla.json"])
        for ref in frame["cameras"].values():
            refs.append((raw / ref["file"], float(ref["timestamp"])))
    return refs


def time_arms(refs, repeats: int) -> dict:
    from omniweave.data.packing.video_frames import FrameReader, decode_frame_png

    def seek():
        return [decode_frame_png(p, t) for p, t in refs]

    def cursor():
        reader = FrameReader()
        try:
            return [reader.png(p, t) for p, t in refs]
        finally:
            reader.close()

    times, outputs = {"seek": [], "cursor": []}, {}
    for r in range(repeats):
        for name, fn in ((("seek", seek), ("cursor", cursor)) if r % 2 == 0 else (("cursor", cursor), ("seek", seek))):
            t0 = time.perf_counter()
            outputs[name] = fn()
            times[name].append(time.perf_counter() - t0)
    if outputs["seek"] != outputs["cursor"]:
        raise AssertionError("the cursor's frames differ from a fresh seek's")
    out = {name: {"seconds": median(ts), "runs": ts, "frames_s": len(refs) / median(ts)} for name, ts in times.items()}
    out["ratio"] = out["seek"]["seconds"] / out["cursor"]["seconds"]
    return out


def table(result: dict) -> str:
    lines = ["| keyframe interval | frames | fresh seek (s) | cursor (s) | cursor frames/s | speed-up |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['gop']} | {r['frames']} | {r['seek']['seconds']:.2f} | {r['cursor']['seconds']:.2f} | "
                     f"{r['cursor']['frames_s']:.0f} | {r['ratio']:.2f}x |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    rows = result["rows"]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["seek"]["frames_s"] for r in rows], 0.4, label="fresh seek per frame", color="tab:gray")
    ax.bar([i + 0.2 for i in x], [r["cursor"]["frames_s"] for r in rows], 0.4, label="cursor (data pack)", color="tab:blue")
    for i, r in zip(x, rows):
        ax.text(i, max(r["seek"]["frames_s"], r["cursor"]["frames_s"]) * 1.03, f"{r['ratio']:.1f}x", ha="center")
    ax.set_xticks(list(x), [f"GOP {r['gop']}" for r in rows])
    ax.set_ylabel("frames/s (median)")
    ax.set_title(f"LeRobot frames for packing, {result['settings']['size']} px")
    ax.legend(fontsize=8)
    save(fig, path, grid=(ax,))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=QUICK_HELP)
    p.add_argument("--episodes", type=int, default=200, help="expert episodes recorded (~4 frames each)")
    p.add_argument("--size", type=int, default=96, help="camera image side (even)")
    p.add_argument("--gop", type=int, nargs="+", default=[1, 30, 250], help="keyframe intervals to compare")
    p.add_argument("--frames", type=int, default=600, help="samples read per arm (in sample order)")
    p.add_argument("--repeats", type=int, default=3, help="timed reads per arm")
    p.add_argument("--work", default=None, help="datasets (default bench/out/vla_frames_work; --quick: a temp dir)")
    p.add_argument("--out", type=Path, default=Path("bench/out"), help="result files go here")
    args = p.parse_args(argv)
    if args.quick:
        note("10 episodes, GOP 1 and 30, 20 frames, 1 repeat")
        args.episodes, args.gop, args.frames, args.repeats, args.size = 10, [1, 30], 20, 1, 32
    work = Path(work_dir(args.work, args.quick, str(args.out / "vla_frames_work")))
    rows = []
    for gop in args.gop:
        refs = camera_refs(make_raw(work, args, gop), args.frames)
        rows.append({"gop": gop, "frames": len(refs), **time_arms(refs, args.repeats)})
        print(f"GOP {gop}: {rows[-1]['ratio']:.2f}x", flush=True)
    result = {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}
    text = table(result)
    print(text)
    write_results(args.out, "vla_frames", text, result, lambda path: plot(result, path),
                  f"{args.episodes} episodes at {args.size} px, {args.frames} samples, {args.repeats} repeats")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
