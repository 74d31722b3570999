"""Benchmark: ``omniweave data convert`` throughput against plain copies of the same bytes.

A generated dataset with realistic media sizes (JPEG photos of ~100-300 KB, MPEG-4 clips of
~1 MB, some text-only rows) is converted with 1 and 2 workers; ``cp -r`` of the media folder and
``tar cf`` of it are the ceiling (they move the same bytes without parsing, validating or
indexing anything). Every command runs as a fresh process (startup included), medians of
``--repeats`` runs after one warm-up (so all reads come from the page cache).

    python bench/convert.py [--samples 300] [--repeats 3] [--out bench/out] [--quick]

``--quick`` (bench/quick.py): 20 rows, 1 repeat, 10 rows per job; not meaningful figures.
"""

from __future__ import annotations

import sys
from pathlib import Path


import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

from figure import pyplot, save  # noqa: E402
from quick import HELP as QUICK_HELP, note, work_dir  # noqa: E402  (bench/, the script's folder)
from synthetic_media import jpeg, mp4  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]




def make_dataset(root: Path, samples: int) -> dict:
    """70% one-image rows, 20% one-video rows, 10% text-only; distinct files per row."""
    media = root / "media"
    media.mkdir(parents=True, exist_ok=True)
    pool_images = [jpeg(h, w, s) for s, (h, w) in enumerate([(480, 640), (600, 800), (720, 960), (768, 1024)] * 3)]
    pool_videos = [mp4(5, 24, 360, 640, s) for s in range(3)]
    rows, nbytes = [], 0
    for i in range(samples):
        kind = i % 10
        if kind < 7:
            name = f"img{i:05d}.jpg"
            data = pool_images[i % len(pool_images)]
            rows.append({"messages": [{"role": "user", "content": "<image>Describe."},
                                      {"role": "assistant", "content": "A gradient."}], "images": [name]})
        elif kind < 9:
            name = f"vid{i:05d}.mp4"
            data = pool_videos[i % len(pool_videos)]
            rows.append({"messages": [{"role": "user", "content": "<video>What moves?"},
                                      {"role": "assistant", "content": "Stripes."}], "videos": [name]})
        else:
            rows.append({"messages": [{"role": "user", "content": f"{i} + 1?"}, {"role": "assistant", "content": str(i + 1)}]})
            continue
        (media / name).write_bytes(data)
        nbytes += len(data)
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "samples": samples, "media_bytes": nbytes,
        "image_kb": [round(len(b) / 1024) for b in pool_images], "video_kb": [round(len(b) / 1024) for b in pool_videos],
    }


def timed(cmd: list[str], cleanup: Path) -> float:
    if cleanup.is_dir():
        shutil.rmtree(cleanup)
    elif cleanup.exists():
        cleanup.unlink()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    report = cleanup / "convert_report.json"  # convert's own clock: no interpreter start-up / imports
    return wall, json.loads(report.read_text())["seconds"] if report.is_file() else wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--maxcount", type=int, default=50, help="rows per job/shard (jobs are the unit of parallelism)")
    p.add_argument("--work", help="scratch folder (default /tmp/omniweave-bench-convert)")
    p.add_argument("--out", default="bench/out")
    p.add_argument("--quick", action="store_true", help=QUICK_HELP + ": 20 rows, 10 per job")
    args = p.parse_args()
    if args.quick:
        args.samples, args.repeats, args.maxcount = 20, 1, 10
        note("20 rows, 1 repeat")
    args.work = work_dir(args.work, args.quick, "/tmp/omniweave-bench-convert")

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    print(f"generating {args.samples} rows under {work} ...", flush=True)
    data = make_dataset(work / "in", args.samples)
    mb = data["media_bytes"] / 1e6
    convert = [sys.executable, "-m", "omniweave", "data", "convert", "--input", str(work / "in/data.jsonl"),
               "--media-dir", str(work / "in/media"), "--output", str(work / "raw"), "--maxcount",
               str(args.maxcount), "--no-progress", "--workers"]
    methods = {
        "cp -r (ceiling)": (["cp", "-r", str(work / "in/media"), str(work / "copy")], work / "copy"),
        "tar cf (ceiling)": (["tar", "cf", str(work / "copy.tar"), "-C", str(work / "in"), "media"], work / "copy.tar"),
        "convert, 1 worker": ([*convert, "1"], work / "raw"),
        "convert, 2 workers": ([*convert, "2"], work / "raw"),
    }
    results = {}
    for name, (cmd, cleanup) in methods.items():
        timed(cmd, cleanup)  # warm-up (page cache, imports)
        runs = [timed(cmd, cleanup) for _ in range(args.repeats)]
        results[name] = {"runs": runs, "median_s": statistics.median(w for w, _ in runs),
                         "median_inner_s": statistics.median(i for _, i in runs)}
    report = json.loads((work / "raw/convert_report.json").read_text())
    assert report["written"] == args.samples, report

    ceiling = results["cp -r (ceiling)"]["median_s"]
    print(f"\n{args.samples} rows, {mb:.1f} MB of media (images ~{min(data['image_kb'])}-{max(data['image_kb'])} KB, "
          f"videos ~{min(data['video_kb'])}-{max(data['video_kb'])} KB); medians of {args.repeats} runs, os.cpu_count()={os.cpu_count()}")
    print(f"| {'method':<20} | {'wall s':>6} | {'samples/s':>9} | {'MB/s':>6} | {'time vs cp -r':>13} "
          f"| {'w/o start-up s':>14} | {'MB/s':>6} |")
    print(f"|{'-' * 22}|{'-' * 7}:|{'-' * 10}:|{'-' * 7}:|{'-' * 14}:|{'-' * 15}:|{'-' * 7}:|")
    for name, r in results.items():
        s, inner = r["median_s"], r["median_inner_s"]
        r.update(samples_per_s=args.samples / s, mb_per_s=mb / s, vs_cp=s / ceiling, inner_mb_per_s=mb / inner)
        print(f"| {name:<20} | {s:6.2f} | {args.samples / s:9.0f} | {mb / s:6.0f} | {s / ceiling:12.1f}x "
              f"| {inner:14.2f} | {mb / inner:6.0f} |")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "convert.json").write_text(json.dumps({"data": data, "results": results}, indent=2))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3))
    names = list(results)
    ax.barh(names, [results[n]["mb_per_s"] for n in names], color=["#999", "#999", "#3a7", "#2a5"])
    for i, n in enumerate(names):
        ax.text(results[n]["mb_per_s"], i, f" {results[n]['mb_per_s']:.0f} MB/s", va="center")
    ax.set_xlabel(f"MB/s of media ({args.samples} rows, {mb:.0f} MB; median of {args.repeats})")
    ax.invert_yaxis()
    ax.set_xlim(0, max(results[n]["mb_per_s"] for n in names) * 1.25)
    save(fig, out / "convert.png")
    print(f"wrote {out / 'convert.png'} and {out / 'convert.json'}")


if __name__ == "__main__":
    main()
