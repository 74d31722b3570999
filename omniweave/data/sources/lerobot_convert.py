"""``omniweave data convert --format lerobot``: a LeRobot v3.0 dataset -> raw VLA shards.

    omniweave data convert --format lerobot --input DATASET_DIR --output RAW \
        [--horizon H] [--stride S] [--drop-short-episodes] [--maxcount N] [--maxsize BYTES] [--strict]

One sample per yielded frame of ``LeRobotDataset.frames(H, S)`` (data/sources/lerobot.py): every
S-th frame of each episode, in the reader's order. A sample is one tar member ``vla.json``: task,
state (raw), actions (H x action_dim, raw), action_is_pad, episode_index, frame_index, index,
timestamp and ``cameras: {key: {"file": path relative to RAW, "timestamp": seconds in that file}}``.
The mp4 files the kept frames reference are copied byte for byte to the same relative path in RAW
(never re-encoded), so RAW is self-contained. Besides the shards and ``.nv-meta/`` (sample_type
``omniweave_vla``) RAW holds ``lerobot_stats.json`` (state / action q01, q99, mean, std; fps,
horizon, ...), ``convert_report.json`` (``kind: "vla"``, input == written + rejected, by reason;
``short_episodes``: the episodes shorter than H, padded or dropped) and ``rejects.jsonl`` (one line
per dropped frame: episode, frame, reason).

Crash safety as for conversations: shards and videos are written under ``RAW/.work/`` and moved
into place only once everything is written. The conversion runs in one process (it writes small
JSON members and copies files); a rerun starts over.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

from omniweave.data.sources import shards as sh
from omniweave.errors import UserError

KIND = "vla"
DEFAULT_HORIZON, DEFAULT_STRIDE = 50, 1
LEROBOT_ONLY = ("horizon", "stride", "drop_short_episodes")  # flags that mean nothing to conversations


def add_arguments(p) -> None:
    from omniweave.argtypes import integer

    p.add_argument("--horizon", type=integer(1), default=None,
                   help=f"--format lerobot: action chunk length H (default {DEFAULT_HORIZON})")
    p.add_argument("--stride", type=integer(1), default=None,
                   help=f"--format lerobot: one sample every S frames of an episode (default {DEFAULT_STRIDE})")
    p.add_argument("--drop-short-episodes", action="store_true", default=None,
                   help="--format lerobot: drop episodes shorter than H instead of padding their action chunks")


def refuse_lerobot_flags(args) -> None:
    """A conversation convert given a LeRobot-only flag: one line naming it."""
    given = [f"--{k.replace('_', '-')}" for k in LEROBOT_ONLY if getattr(args, k, None) is not None]
    if given:
        raise UserError(f"{', '.join(given)} only apply to --format lerobot (this convert reads "
                        f"{'--dataset-info' if args.dataset_info else 'conversations'})")


def _refuse_conversation_flags(args) -> None:
    from omniweave.data.media.files import DEFAULT_MAX_MEDIA_BYTES
    from omniweave.data.media.vision import DEFAULT_MAX_IMAGE_PIXELS
    from omniweave.data.sources.mapping import COLUMN_FIELDS, TAG_FIELDS

    named = {"--dataset-info": args.dataset_info, "--dataset": args.dataset, "--media-dir": args.media_dir,
             "--mapping": args.mapping, "--auto-placeholders": args.auto_placeholders,
             "--max-media-size": args.max_media_size != DEFAULT_MAX_MEDIA_BYTES,
             "--max-image-pixels": args.max_image_pixels != DEFAULT_MAX_IMAGE_PIXELS}
    named.update({f"--{k.replace('_', '-')}-key": getattr(args, f"{k}_key", None) for k in COLUMN_FIELDS})
    named.update({f"--{k.replace('_', '-')}": getattr(args, k, None) for k in TAG_FIELDS})
    given = [flag for flag, value in named.items() if value not in (None, False)]
    if given:
        raise UserError(f"--format lerobot reads a LeRobot dataset directory; {', '.join(given)} only apply to "
                        "conversations")
    if not args.input or len(args.input) != 1:
        raise UserError("--format lerobot needs --input DATASET_DIR: one LeRobot v3.0 dataset directory")


def run(args) -> int:
    from tqdm import tqdm

    from omniweave.data.sources.convert import _clear_output
    from omniweave.data.sources.lerobot import LeRobotDataset

    t0 = time.perf_counter()
    _refuse_conversation_flags(args)
    horizon = args.horizon or DEFAULT_HORIZON
    stride = args.stride or DEFAULT_STRIDE
    src, out = Path(args.input[0]), Path(args.output)
    if not src.is_dir():
        raise UserError(f"--input {src}: not a directory (--format lerobot reads a LeRobot dataset directory)")
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise UserError(f"--output {out} must lie outside the dataset {src}")
    ds = LeRobotDataset(src, drop_short_episodes=bool(args.drop_short_episodes))
    stats = ds.quantile_stats()

    out.mkdir(parents=True, exist_ok=True)
    _clear_previous(out)
    _clear_output(out, keep_work=False)
    work = out / ".work"
    work.mkdir()
    total = sum(-(-int(ep["length"]) // stride) for ep in ds.episodes)  # for the bar; input is counted below
    bar = tqdm(total=total, unit="frame", desc="convert", disable=args.no_progress or None, dynamic_ncols=True)
    records, writer, written, videos = [], None, 0, set()
    episodes, tasks = set(), Counter()

    def close_writer():
        nonlocal writer
        if writer is not None:
            records.append(sh.finalize_shard(writer, work / f"part-{len(records):06d}.tar"))
        writer = None

    for ex in ds.frames(horizon, stride):
        if writer is not None and (writer.count >= args.maxcount or writer.size >= args.maxsize):
            close_writer()
        if writer is None:
            writer = sh.ShardWriter(work / f"part-{len(records):06d}.tar.tmp")
        writer.write(sh.sample_key(written), {"vla.json": json.dumps(sample_json(ex)).encode()})
        written += 1
        videos.update(path for path, _ in ex["cameras"].values())
        episodes.add(ex["episode_index"])
        tasks[ex["task"]] += 1
        bar.update(written + len(ds.drops) - bar.n)
    close_writer()
    bar.update(written + len(ds.drops) - bar.n)
    bar.close()
    video_bytes = 0
    for rel in sorted(videos):  # byte for byte, never re-encoded
        dst = work / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, dst)
        video_bytes += dst.stat().st_size
    (work / "lerobot_stats.json").write_text(json.dumps(stats_json(ds, stats, horizon, stride), indent=2) + "\n")
    return _publish(args, ds, out, work, records, written, videos, video_bytes, episodes, tasks, horizon, stride, t0)


def sample_json(ex: dict) -> dict:
    return {"task": ex["task"], "state": ex["state"].tolist(), "actions": ex["actions"].tolist(),
            "action_is_pad": ex["action_is_pad"].tolist(), "episode_index": ex["episode_index"],
            "frame_index": ex["frame_index"], "index": ex["index"],
            "timestamp": ex["timestamp"],
            "cameras": {k: {"file": path, "timestamp": ts} for k, (path, ts) in ex["cameras"].items()}}


def stats_json(ds, stats: dict, horizon: int, stride: int) -> dict:
    return {"codebase_version": ds.info["codebase_version"], "fps": ds.fps, "horizon": horizon, "stride": stride,
            "state_key": ds.state_key, "action_key": ds.action_key,
            "state_dim": int(stats["state"]["q01"].size), "action_dim": int(stats["action"]["q01"].size),
            "cameras": ds.camera_keys, "stats_source": ds.stats_source,
            **{name: {k: v.tolist() for k, v in s.items()} for name, s in stats.items()}}


def short_episodes(ds, horizon: int) -> dict:
    """The episodes shorter than the horizon and their frames (their lengths summed): by default
    every chunk of such an episode is padded past its end, which no drop reason records, so the
    report counts them either way (``--drop-short-episodes`` drops them instead)."""
    lengths = [int(ep["length"]) for ep in ds.episodes if int(ep["length"]) < horizon]
    return {"episodes": len(lengths), "frames": sum(lengths)}


def _clear_previous(out: Path) -> None:
    """What a previous LeRobot convert into ``out`` wrote beside the shards (only when it said so)."""
    report = out / "convert_report.json"
    if report.is_file() and json.loads(report.read_text()).get("kind") == KIND:
        shutil.rmtree(out / "videos", ignore_errors=True)
        (out / "lerobot_stats.json").unlink(missing_ok=True)


def _publish(args, ds, out: Path, work: Path, records: list, written: int, videos: set, video_bytes: int,
             episodes: set, tasks: Counter, horizon: int, stride: int, t0: float) -> int:
    """Move the finished output from .work into RAW: videos, shards (.idx first), metadata, report."""
    for rel in sorted(videos):
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(work / rel, out / rel)
    shard_records = sh.publish_shards(work, out, records, sh.VLA_SAMPLE_TYPE)
    os.replace(work / "lerobot_stats.json", out / "lerobot_stats.json")
    with open(out / "rejects.jsonl", "w") as f:
        for episode, frame, reason in ds.drops:
            f.write(json.dumps({"episode": episode, "frame": frame, "reason": reason}) + "\n")
    by_reason = dict(sorted(ds.dropped.items()))
    rejected = sum(by_reason.values())
    assert rejected == len(ds.drops), "drop accounting is broken"
    seconds = time.perf_counter() - t0
    total_bytes = sum(s["bytes"] for s in shard_records)
    short = short_episodes(ds, horizon)
    report = {
        "kind": KIND, "format": "lerobot", "source": str(ds.root), "codebase_version": ds.info["codebase_version"],
        "input": written + rejected, "written": written, "rejected": rejected, "rejected_by_reason": by_reason,
        "episodes": len(ds.episodes), "episodes_written": len(episodes), "tasks": dict(sorted(tasks.items())),
        "cameras": ds.camera_keys, "horizon": horizon, "stride": stride,
        "drop_short_episodes": ds.drop_short_episodes, "short_episodes": short,
        "video_files": len(videos), "video_bytes": video_bytes,
        "bytes": total_bytes, "seconds": round(seconds, 3), "maxcount": args.maxcount, "maxsize": args.maxsize,
        "shards": [{"name": s["name"], "count": s["count"], "bytes": s["bytes"]} for s in shard_records],
    }
    (out / "convert_report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    reasons = ", ".join(f"{k}: {v}" for k, v in by_reason.items())
    short_note = ""
    if short["episodes"]:
        handled = "dropped" if ds.drop_short_episodes else "their action chunks padded"
        short_note = f"; {short['episodes']} episode(s) shorter than H={horizon} ({short['frames']} frames): {handled}"
    print(f"convert: {written + rejected} frames of {len(ds.episodes)} episode(s) -> {written} samples in "
          f"{len(shard_records)} shard(s) ({total_bytes / 1e6:.1f} MB), {len(videos)} video file(s) copied "
          f"({video_bytes / 1e6:.1f} MB), {rejected} dropped{f' ({reasons})' if reasons else ''} in {seconds:.1f}s "
          f"-> {out}" + (f"; see {out / 'rejects.jsonl'}" if rejected else "") + short_note)
    if rejected and not written:
        print(f"omniweave data convert: error: every frame was dropped ({reasons}); each frame and its reason is in "
              f"{out / 'rejects.jsonl'}", file=sys.stderr)
        return 1
    return 1 if args.strict and rejected else 0
