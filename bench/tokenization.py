"""Benchmark: metadata-only tokenization (what the packer runs) vs full media processing.

Both paths run on the same synthetic samples of realistic sizes: JPEG photos (VGA to 4K-ish,
including panoramas) and MPEG-4 clips (640x360, 30 fps, a few seconds). "metadata" =
``SampleProcessor.tokenize`` (header probe + template + expansion + M-RoPE); "full" = the same
plus ``process_media`` on every media item (decode, resize, normalise, patchify), i.e. what a
pipeline that decodes media to count tokens pays.

    python bench/tokenization.py [--images 48] [--videos 6] [--repeats 3] [--out bench/out] [--quick]

``--quick`` (bench/quick.py): 6 images, 1 video, 1 repeat; not meaningful figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from omniweave.data.sample import Conversation, Message, RawSample  # noqa: E402
from omniweave.data.text.tokenize import SampleProcessor  # noqa: E402
from figure import pyplot, save  # noqa: E402
from quick import HELP as QUICK_HELP, note  # noqa: E402  (bench/, the script's folder)
from synthetic_media import jpeg, mp4  # noqa: E402

IMAGE_SIZES = [(480, 640), (720, 1280), (1080, 1920), (1200, 800), (400, 3000), (2160, 3840)]




def make_samples(n_images: int, n_videos: int) -> list[RawSample]:
    samples = []
    for i in tqdm(range(n_images), desc="images", leave=False):
        h, w = IMAGE_SIZES[i % len(IMAGE_SIZES)]
        conv = Conversation(f"img{i}", [Message("user", "<image>Describe the picture in detail."),
                                        Message("assistant", "A colourful gradient with some noise. " * 4)], images=["img0.jpg"])
        samples.append(RawSample(f"img{i}", conv, {"img0.jpg": jpeg(h, w, i, noise=24, quality=90)}))
    for i in tqdm(range(n_videos), desc="videos", leave=False):
        conv = Conversation(f"vid{i}", [Message("user", "<video>What happens in this clip?"),
                                        Message("assistant", "Stripes drift to the left.")], videos=["vid0.mp4"])
        samples.append(RawSample(f"vid{i}", conv, {"vid0.mp4": mp4(3 + i % 3, 30, 360, 640, i, bit_rate=2_000_000)}))
    return samples


def run_pass(proc: SampleProcessor, samples: list[RawSample], full: bool) -> float:
    start = time.perf_counter()
    for raw in samples:
        sample = proc.tokenize(raw)
        if full:
            for span in sample.media:
                proc.process_media(span, raw.media[span.part])
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--videos", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    parser.add_argument("--quick", action="store_true", help=QUICK_HELP + ": 6 images, 1 video")
    args = parser.parse_args()
    if args.quick:
        args.images, args.videos, args.repeats = 6, 1, 1
        note("6 images, 1 video, 1 repeat")

    proc = SampleProcessor({"tokenizer": "demo", "template": "chatml", "max_len": 32768})
    samples = make_samples(args.images, args.videos)
    groups = {"images": [s for s in samples if s.conversation.images],
              "videos": [s for s in samples if s.conversation.videos], "all": samples}
    rows = []
    for name, group in groups.items():
        if not group:
            continue
        # the metadata pass takes milliseconds: 10x more passes for a stable median
        meta = statistics.median(run_pass(proc, group, False) for _ in range(10 * args.repeats))
        full = statistics.median(run_pass(proc, group, True) for _ in tqdm(range(args.repeats), desc=f"full {name}", leave=False))
        rows.append({"data": name, "samples": len(group), "metadata_samples_per_s": len(group) / meta,
                     "full_samples_per_s": len(group) / full, "speedup": full / meta})
    print(f"{'data':8} {'samples':>7} {'metadata samples/s':>19} {'full samples/s':>15} {'speedup':>8}")
    for r in rows:
        print(f"{r['data']:8} {r['samples']:7d} {r['metadata_samples_per_s']:19.1f} {r['full_samples_per_s']:15.2f} {r['speedup']:7.0f}x")

    plt = pyplot()
    args.out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["full_samples_per_s"] for r in rows], 0.4, label="full media processing (baseline)")
    ax.bar(x + 0.2, [r["metadata_samples_per_s"] for r in rows], 0.4, label="metadata-only counting")
    ax.set_xticks(x, [f"{r['data']} ({r['speedup']:.0f}x)" for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("samples / s (log)")
    ax.set_title("Tokenization throughput, 1 CPU process")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    save(fig, args.out / "tokenize.png")
    (args.out / "tokenize.json").write_text(json.dumps(rows, indent=2))
    best = rows[-1]
    print(f"tokenize bench: metadata-only {best['metadata_samples_per_s']:.1f} samples/s vs full "
          f"{best['full_samples_per_s']:.2f} samples/s ({best['speedup']:.0f}x) -> {args.out / 'tokenize.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
