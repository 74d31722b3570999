"""``omniweave data inspect PATH``: a human summary of a raw shard directory or a packed dataset.

Raw (``RAW/.nv-meta`` + shards): samples by modality (text-only / image / video / audio / mixed),
turns per conversation, media sizes (bytes, and pixel sizes / frames / audio durations, sample
rates and channels read from the headers),
the reject summary of ``convert_report.json``, and a few rendered samples.
VLA shards (``convert --format lerobot``, ``.nv-meta`` sample_type omniweave_vla): ``inspect_vla``.
Clip shards (``convert --format clips``, sample_type omniweave_clips): ``inspect_clips`` (clips,
videos / images, frames / fps / sizes, caption lengths, rejects, example clips).
Packed (``PATH/manifest.json``): handed to ``omniweave.data.packing.inspect``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

MODALITIES = ("text-only", "image", "video", "audio", "mixed")
ROLE_COLORS = {"system": "35", "user": "36", "assistant": "32", "observation": "33", "function": "33"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="raw dataset directory (convert output) or packed dataset directory")
    p.add_argument("--show", type=int, default=3, help="samples to render")
    p.add_argument("--max-scan", type=int, default=20000, help="read at most this many samples for the statistics")


def run(args) -> int:
    path = Path(args.path)
    color = sys.stdout.isatty()
    if (path / "manifest.json").is_file():
        try:
            from omniweave.data.packing.inspect import inspect_packed
        except ImportError as e:
            print(f"omniweave data inspect: {path} is a packed dataset, but packed inspection is not "
                  f"available in this install ({e})", file=sys.stderr)
            return 2
        return int(inspect_packed(path, color=color, show=args.show) or 0)
    try:
        from omniweave.data.sources.shards import META_DIR, VLA_SAMPLE_TYPE, RawDataset

        ds = RawDataset(path)
    except (FileNotFoundError, ValueError) as e:
        message = str(e)
        report = path / "convert_report.json"
        rep = json.loads(report.read_text()) if report.is_file() else None
        if rep is not None and not rep["written"]:  # a convert that kept nothing
            reasons = ", ".join(f"{k}: {v}" for k, v in rep["rejected_by_reason"].items())
            unit = "frame" if rep.get("kind") == "vla" else "row"
            message = (f"{path}: convert kept no sample: every one of its {rep['input']} {unit}(s) was rejected "
                       f"({reasons}); each {unit} and its reason is in {path / 'rejects.jsonl'}")
        print(f"omniweave data inspect: {message}", file=sys.stderr)
        return 2
    from omniweave.data.sources.clips_convert import CLIPS_SAMPLE_TYPE, KIND as CLIPS_KIND, raw_kind

    if raw_kind(path) in (CLIPS_SAMPLE_TYPE, CLIPS_KIND):
        from omniweave.data.sources.clips_convert import ClipRawDataset

        return inspect_clips(ClipRawDataset(path), show=args.show, max_scan=args.max_scan, color=color)
    meta = path / META_DIR / "dataset.yaml"
    if meta.is_file() and f"sample_type: {VLA_SAMPLE_TYPE}" in meta.read_text(errors="replace"):
        return inspect_vla(ds, show=args.show, max_scan=args.max_scan, color=color)
    return inspect_raw(ds, show=args.show, max_scan=args.max_scan, color=color)


def _c(text: str, code: str, color: bool) -> str:
    return f"\033[{code}m{text}\033[0m" if color else text


def _stats(values: list[float], fmt=lambda v: f"{v:,.0f}") -> str:
    if not values:
        return "-"
    a = np.asarray(values, dtype=np.float64)
    return f"min {fmt(a.min())}  median {fmt(float(np.median(a)))}  max {fmt(a.max())}  (n={len(a)})"


def _bar_histogram(counter: Counter, color: bool, width: int = 40) -> list[str]:
    top = max(counter.values())
    return [
        f"    {key:>4} {_c('█' * max(1, round(width * n / top)), '34', color)} {n}"
        for key, n in sorted(counter.items())
    ]


def inspect_raw(ds, show: int = 3, max_scan: int = 20000, color: bool = False) -> int:
    from omniweave.data.media.audio import probe_audio
    from omniweave.data.media.vision import MediaError, probe_image, probe_video

    probes = {"image": probe_image, "video": probe_video, "audio": probe_audio}
    total = len(ds)
    scanned = min(total, max_scan)
    modality, turns, roles = Counter(), Counter(), Counter()
    media_bytes = {kind: [] for kind in probes}  # kind -> bytes per item
    headers = {kind: [] for kind in probes}  # kind -> the probe's info per readable item
    bad_headers = 0
    per_sample_images = Counter()
    for i, sample in enumerate(ds):
        if i >= scanned:
            break
        conv = sample.conversation
        items = {"image": conv.images, "video": conv.videos, "audio": conv.audios}
        kinds = [kind for kind, names in items.items() if names]
        modality["mixed" if len(kinds) > 1 else kinds[0] if kinds else "text-only"] += 1
        per_sample_images[len(conv.images)] += 1
        turns[sum(m.role in ("assistant", "function") for m in conv.messages)] += 1
        roles.update(m.role for m in conv.messages)
        for kind, names in items.items():
            for name in names:
                data = sample.media[name]
                media_bytes[kind].append(len(data))
                try:
                    headers[kind].append(probes[kind](data))
                except MediaError:
                    bad_headers += 1

    size = sum(s.bytes for s in ds.shards)
    bold = lambda t: _c(t, "1", color)  # noqa: E731
    print(bold(f"raw dataset {ds.root}"))
    print(f"  {total:,} samples in {len(ds.shards)} shard(s), {size / 1e6:,.1f} MB"
          + (f"; statistics over the first {scanned:,}" if scanned < total else ""))
    print(bold("  modality"))
    for key in MODALITIES:
        n = modality[key]
        print(f"    {key:<10} {n:>8,}  {100 * n / max(1, scanned):5.1f}%")
    multi = sum(n for k, n in per_sample_images.items() if k > 1)
    print(f"    multi-image samples: {multi:,}; roles: " + ", ".join(f"{r} {n:,}" for r, n in sorted(roles.items())))
    print(bold("  assistant turns per conversation"))
    print("\n".join(_bar_histogram(turns, color)) if turns else "    -")
    print(bold("  media"))
    images, videos, audios = headers["image"], headers["video"], headers["audio"]
    print(f"    images: {len(media_bytes['image']):,}; bytes {_stats(media_bytes['image'])}")
    if images:
        print(f"            height {_stats([i.height for i in images])}"
              f"\n            width  {_stats([i.width for i in images])}")
    print(f"    videos: {len(media_bytes['video']):,}; bytes {_stats(media_bytes['video'])}")
    if videos:
        print(f"            frames {_stats([v.num_frames for v in videos])}"
              f"\n            height {_stats([v.height for v in videos])}"
              f"\n            width  {_stats([v.width for v in videos])}")
    print(f"    audios: {len(media_bytes['audio']):,}; bytes {_stats(media_bytes['audio'])}")
    if audios:
        seconds = [a.duration_s for a in audios]
        rates, channels = Counter(a.sample_rate for a in audios), Counter(a.channels for a in audios)
        print(f"            seconds {_stats(seconds, lambda v: f'{v:,.2f}')}, total {sum(seconds):,.1f} s"
              f"\n            sample rates " + ", ".join(f"{r} Hz: {n:,}" for r, n in sorted(rates.items()))
              + "; channels " + ", ".join(f"{c}: {n:,}" for c, n in sorted(channels.items())))
    if bad_headers:
        print(_c(f"    {bad_headers} media item(s) with unreadable headers", "31", color))

    report_file = ds.root / "convert_report.json"
    if report_file.is_file():
        rep = json.loads(report_file.read_text())
        print(bold("  convert report"))
        print(f"    input {rep['input']:,} rows: written {rep['written']:,}, rejected {rep['rejected']:,}"
              f" in {rep.get('seconds', 0):.1f}s")
        for name, d in rep.get("datasets", {}).items():  # --dataset-info: per entry
            print(f"    dataset {name}: {d['input']:,} rows, written {d['written']:,}, rejected {d['rejected']:,}")
        if rep.get("media_items"):
            print("    media stored: " + ", ".join(f"{kind} {n:,}" for kind, n in rep["media_items"].items()))
        for reason, n in rep.get("rejected_by_reason", {}).items():
            print(_c(f"      {reason:<22} {n:,}", "31", color))
        for file, columns in rep.get("unused_columns", {}).items():
            print(_c(f"    warning: {Path(file).name}: unmapped column(s) kept in meta.extra, not trained on: "
                     + ", ".join(f"{c} ({n:,} rows)" for c, n in columns.items()), "33", color))
        if rep["rejected"]:
            print(f"    details: {ds.root / 'rejects.jsonl'}")

    for i in np.linspace(0, total - 1, min(show, total)).round().astype(int).tolist() if show > 0 and total else []:
        sample = ds[i]
        conv = sample.conversation
        print(bold(f"  sample {i} key={sample.key} id={conv.id}") + f"  source={conv.meta.get('source')}:{conv.meta.get('index')}")
        for m in conv.messages:
            text = m.content if len(m.content) <= 300 else m.content[:300] + " …"
            print(f"    {_c(f'{m.role:>11}', ROLE_COLORS.get(m.role, '0'), color)}: {text}")
        for name in [*conv.images, *conv.videos, *conv.audios]:
            print(f"    {'':>11}  [{name}: {len(sample.media[name]):,} bytes]")
    print(f"inspect: {total:,} samples, {len(ds.shards)} shard(s), "
          + ", ".join(f"{k} {modality[k]:,}" for k in MODALITIES))
    return 0


def inspect_vla(ds, show: int = 3, max_scan: int = 20000, color: bool = False) -> int:
    """Per-frame robot samples: episodes, tasks, cameras, horizon, action padding, drops."""
    from omniweave.data.sources.shards import parse_sample_bytes

    total, scanned = len(ds), min(len(ds), max_scan)
    episodes, tasks, cameras, padded = set(), Counter(), Counter(), []
    horizons, state_dims, action_dims = Counter(), Counter(), Counter()
    samples = {}
    picks = set(np.linspace(0, total - 1, min(show, total)).round().astype(int).tolist() if show > 0 and total else [])
    for i in range(scanned):
        s = json.loads(parse_sample_bytes(ds.read_bytes(i))[1]["vla.json"])
        episodes.add(s["episode_index"])
        tasks[s["task"]] += 1
        cameras.update(list(s["cameras"]))
        horizons[len(s["actions"])] += 1
        state_dims[len(s["state"])] += 1
        action_dims[len(s["actions"][0])] += 1
        padded.append(sum(s["action_is_pad"]))
        if i in picks:
            samples[i] = s
    bold = lambda t: _c(t, "1", color)  # noqa: E731
    rep_file = ds.root / "convert_report.json"
    rep = json.loads(rep_file.read_text()) if rep_file.is_file() else {}
    print(bold(f"raw VLA dataset {ds.root}") + (f"  (from {rep['source']})" if rep.get("source") else ""))
    print(f"  {total:,} samples in {len(ds.shards)} shard(s), {sum(s.bytes for s in ds.shards) / 1e6:,.1f} MB"
          + (f"; statistics over the first {scanned:,}" if scanned < total else ""))
    show_counts = lambda c: ", ".join(f"{k}: {n:,}" for k, n in sorted(c.items()))  # noqa: E731
    print(f"  episodes {len(episodes):,}; horizon {show_counts(horizons)}; stride {rep.get('stride', '?')}; "
          f"state dim {show_counts(state_dims)}; action dim {show_counts(action_dims)}")
    print(f"  padded action steps per sample {_stats(padded)}")
    print(bold("  tasks"))
    for task, n in tasks.most_common(10):
        print(f"    {n:>8,}  {task}")
    if len(tasks) > 10:
        print(f"    ... and {len(tasks) - 10} more")
    print(bold("  cameras") + " " + (show_counts(cameras) or "none"))
    if rep:
        print(bold("  convert report"))
        print(f"    input {rep['input']:,} frames: written {rep['written']:,}, dropped {rep['rejected']:,}; "
              f"{rep.get('video_files', 0)} video file(s), {rep.get('video_bytes', 0) / 1e6:,.1f} MB")
        for reason, n in rep.get("rejected_by_reason", {}).items():
            print(_c(f"      {reason:<28} {n:,}", "31", color))
        if rep["rejected"]:
            print(f"    details: {ds.root / 'rejects.jsonl'}")
    for i, s in sorted(samples.items()):
        print(bold(f"  sample {i}") + f"  episode {s['episode_index']} frame {s['frame_index']} "
              f"(index {s['index']}, t={s['timestamp']:.3f}s): {s['task']}")
        print(f"    state {s['state']}; actions[0] {s['actions'][0]}; padded {sum(s['action_is_pad'])}")
        for key, cam in s["cameras"].items():
            print(f"    {key}: {cam['file']} @ {cam['timestamp']:.3f}s")
    print(f"inspect: {total:,} VLA samples, {len(ds.shards)} shard(s), {len(episodes):,} episode(s), "
          f"{len(tasks):,} task(s), {len(cameras)} camera(s)")
    return 0


def inspect_clips(ds, show: int = 3, max_scan: int = 20000, color: bool = False) -> int:
    """Caption + video / image clips (``convert --format clips``): clips by media, frames, fps, sizes,
    caption lengths, the convert report's rejects and a few example clips (``ds``: ClipRawDataset)."""
    total, scanned = len(ds), min(len(ds), max_scan)
    media, sizes, fps_unknown = Counter(), Counter(), 0
    frames, fps, widths, heights, nbytes, cap_chars, cap_words = [], [], [], [], [], [], []
    for i, clip in enumerate(ds):
        if i >= scanned:
            break
        m = clip.meta
        media[m.get("media", "?")] += 1
        frames.append(m["frames"])
        if m.get("fps"):
            fps.append(m["fps"])
        else:
            fps_unknown += 1
        widths.append(m["width"])
        heights.append(m["height"])
        sizes[f"{m['width']}x{m['height']}"] += 1
        nbytes.append(len(clip.data))
        caption = m.get("caption") or ""
        cap_chars.append(len(caption))
        cap_words.append(len(caption.split()))
    bold = lambda t: _c(t, "1", color)  # noqa: E731
    print(bold(f"raw clips dataset {ds.root}"))
    print(f"  {total:,} clips in {len(ds.shards)} shard(s), {sum(s.bytes for s in ds.shards) / 1e6:,.1f} MB"
          + (f"; statistics over the first {scanned:,}" if scanned < total else ""))
    print(f"  videos {media['video']:,}, images {media['image']:,}"
          + "".join(f", {k} {n:,}" for k, n in sorted(media.items()) if k not in ("video", "image")))
    print(bold("  media"))
    print(f"    frames {_stats(frames)}, total {sum(frames):,}")
    print(f"    fps    {_stats(fps, lambda v: f'{v:,.2f}')}" + (f"; unknown {fps_unknown:,}" if fps_unknown else ""))
    print(f"    width  {_stats(widths)}\n    height {_stats(heights)}")
    print(f"    bytes  {_stats(nbytes)}")
    by_frames = Counter(frames)
    if len(by_frames) <= 16:
        print(bold("  frames per clip"))
        print("\n".join(_bar_histogram(by_frames, color)))
    if sizes:
        print(bold("  sizes (width x height)"))
        print("\n".join(_bar_histogram(Counter(dict(sizes.most_common(10))), color)))
        if len(sizes) > 10:
            print(f"    ... and {len(sizes) - 10} more")
    print(bold("  captions") + f"  characters {_stats(cap_chars)}; words {_stats(cap_words)}")
    rep_file = ds.root / "convert_report.json"
    rep = json.loads(rep_file.read_text()) if rep_file.is_file() else {}
    if rep:
        print(bold("  convert report"))
        print(f"    input {rep['input']:,} rows: written {rep['written']:,}, rejected {rep['rejected']:,}"
              f" in {rep.get('seconds', 0):.1f}s")
        for reason, n in rep.get("rejected_by_reason", {}).items():
            print(_c(f"      {reason:<22} {n:,}", "31", color))
        if rep["rejected"]:
            print(f"    details: {ds.root / 'rejects.jsonl'}")
    for i in np.linspace(0, total - 1, min(show, total)).round().astype(int).tolist() if show > 0 and total else []:
        clip = ds[i]
        m = clip.meta
        rate = f" @ {m['fps']:g} fps" if m.get("fps") else ""
        print(bold(f"  clip {i} key={clip.key} id={m.get('id')}") + f"  source={m.get('source')}")
        print(f"    caption: {m.get('caption')}")
        print(f"    {m.get('media')} {m.get('file')}: {len(clip.data):,} bytes, {m['frames']} frame(s){rate}, "
              f"{m['width']}x{m['height']}")
    print(f"inspect: {total:,} clips, {len(ds.shards)} shard(s), {media['video']:,} video(s), "
          f"{media['image']:,} image(s), {sum(frames):,} frames")
    return 0
