"""Human summary of a packed dataset: efficiency, fill histogram, and one pack rendered as text
with ``<image×N>`` / ``<video×N>`` / ``<audio×N>`` markers (one per run of pads: an audio clip
shows one marker per encoder item) and the loss-carrying tokens highlighted
(green with ANSI colour, ``[[…]]`` without). ``omniweave data inspect PACKED`` dispatches here.
A diffusion dataset (manifest ``kind: "diffusion"``: documents are clips whose tokens are placeholders)
is summarised by ``inspect_diffusion`` instead: clips, latent grids, fill, latent / text widths, drops."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from omniweave.data.packing.stats import text_histogram
from omniweave.data.packing.packed import PackedDataset
from omniweave.data.text.template import IGNORE_INDEX

GREEN, CYAN, DIM, RESET = "\x1b[32m", "\x1b[36m", "\x1b[2m", "\x1b[0m"


def render_pack(pack: dict, tokenizer, color: bool, max_chars: int | None = 4000) -> str:
    """Documents of one pack, separated by a rule; targets of the loss highlighted."""
    ids, labels, cu = pack["input_ids"], pack["labels"], pack["cu_seqlens"]
    target = np.zeros(len(ids), bool)
    target[1:] = labels[:-1] != IGNORE_INDEX  # token j is predicted when labels[j-1] is set
    vision = np.full(len(ids), -1)
    run_length = {}  # first row of a run of pad tokens -> its length
    for k, m in enumerate(pack["media"]):
        for start, n in m.get("pieces") or [(m["start"], m["length"])]:
            vision[start : start + n] = k
            run_length[start] = n
    out = []
    for d in range(len(cu) - 1):
        a, b = int(cu[d]), int(cu[d + 1])
        doc = pack["docs"][d]
        out.append(f"{DIM if color else ''}── doc {d}: {doc['id']} ({b - a} tokens){RESET if color else ''}\n")
        j = a
        while j < b:
            if vision[j] >= 0:
                m = pack["media"][vision[j]]
                out.append(f"{CYAN if color else ''}<{m['kind']}×{run_length[j]}>{RESET if color else ''}")
                j += run_length[j]
                continue
            e = j
            while e < b and vision[e] < 0 and target[e] == target[j]:
                e += 1
            text = tokenizer.decode(ids[j:e].tolist())
            if target[j]:
                text = f"{GREEN}{text}{RESET}" if color else f"[[{text}]]"
            out.append(text)
            j = e
        out.append("\n")
    text = "".join(out)
    if max_chars is not None and len(text) > max_chars:
        text = text[:max_chars] + f"\n… ({len(text) - max_chars} more characters)"
    return text


def inspect_packed(root, color: bool, pack_id: int = 0, show: int | None = None) -> int:
    """``show``: packs rendered by ``inspect_diffusion`` (evenly spaced; None: one); other kinds render ``pack_id``."""
    from omniweave.data.text.tokenizer import load_tokenizer

    root = Path(root)
    ds = PackedDataset(root)
    m = ds.manifest
    stats_file = root / "stats.json"
    s = json.loads(stats_file.read_text()) if stats_file.is_file() else {}
    if m.get("kind") == "diffusion":
        return inspect_diffusion(root, ds, s, color, show=1 if show is None else show)
    print(f"packed dataset {root}: {len(ds)} packs of {m['capacity']} tokens ({m['algorithm']}), "
          f"{len(m['packed_shards'])} shard(s), built from {len(m['source'])} raw shard(s)")
    if s:
        mod = s["modalities"]
        print(f"  samples {s['samples_packed']}/{s['samples']} packed, efficiency {s['efficiency']:.2%} "
              f"({s['real_tokens']} real / {s['capacity_tokens']} capacity tokens), loss tokens {s['loss_tokens']}")
        print(f"  text-only {mod['text_only_samples']}, with image {mod['image_samples']}, with video "
              f"{mod['video_samples']} ({mod['images']} images, {mod['videos']} videos, {s['vision_tokens']} vision tokens)")
        if mod.get("audios"):
            print(f"  with audio {mod['audio_samples']} ({mod['audios']} clips, {mod['audio_seconds']:.1f} s, "
                  f"{mod['audio_bytes']:,} bytes, {s['audio_tokens']} audio tokens)")
        print(f"  truncated {s['truncated']}, dropped {s['dropped_total']} {s['dropped'] or ''}")
        print(f"  attention cost spread: max/mean {s['attention_cost_spread']['max_over_mean']:.2f}, "
              f"cv {s['attention_cost_spread']['cv']:.2f}")
    fills = []
    for sh in m["packed_shards"]:
        fills += [r["length"] for r in json.loads((root / f"{sh['name']}.json").read_text())["packs"]]
    print("  pack fill (% of capacity):")
    for row in text_histogram(np.asarray(fills) / m["capacity"] * 100, 0, 100, unit="%"):
        print("   " + row)
    if 0 <= pack_id < len(ds):
        tok = load_tokenizer(m["data_cfg"].get("tokenizer", "demo"))
        pack = ds[pack_id]
        print(f"\npack {pack_id}: {len(pack['input_ids'])} tokens, {len(pack['docs'])} docs, "
              f"{len(pack['media'])} media, {pack['num_loss_tokens']} loss tokens "
              f"({'green' if color else '[[…]]'} = predicted by the loss)")
        print(render_pack(pack, tok, color))
    return 0


def _dist(values, fmt=lambda v: f"{v:,.0f}") -> str:
    if not len(values):
        return "-"
    a = np.asarray(values, dtype=np.float64)
    return f"min {fmt(a.min())}  median {fmt(float(np.median(a)))}  max {fmt(a.max())}"


def _counts(counter: Counter) -> str:
    return ", ".join(f"{k}: {n:,}" for k, n in sorted(counter.items())) or "-"


def inspect_diffusion(root: Path, ds: PackedDataset, s: dict, color: bool, show: int = 1) -> int:
    """A packed diffusion dataset: its clips (latent grid, tokens, frames, size, text length) per shown
    pack, and overall packs, clips, fill, latent dtype / channels, text width and drops by reason."""
    bold = (lambda t: f"\x1b[1m{t}{RESET}") if color else (lambda t: t)
    m = ds.manifest
    capacity = m["capacity"]
    fills, latent, text_width, text_len, sizes, frames, tokens = [], Counter(), Counter(), [], Counter(), Counter(), []
    clips, per_pack, images = 0, [], Counter()
    for sh in m["packed_shards"]:
        for rec in json.loads((root / f"{sh['name']}.json").read_text())["packs"]:
            fills.append(rec["length"])
            per_pack.append(len(rec["docs"]))
            for doc in rec["docs"]:
                clips += 1
                tokens.append(doc["length"])
                arrays, clip = doc.get("arrays", {}), doc.get("clip", {})
                if "latents" in arrays:
                    a = arrays["latents"]
                    latent[f"{np.dtype(a['dtype']).name} x {a['shape'][-1]}"] += 1
                if "image" in arrays:  # image-to-video (diffusion/data.py i2v_condition)
                    images[" x ".join(map(str, arrays["image"]["shape"]))] += 1
                if "text" in arrays:
                    text_width[arrays["text"]["shape"][-1]] += 1
                    text_len.append(arrays["text"]["shape"][0])
                if clip:
                    sizes[f"{clip['height']}x{clip['width']}"] += 1
                    frames[clip["frames"]] += 1
    diff = (m.get("data_cfg") or {}).get("diffusion") or {}
    codecs = diff.get("codecs") or {}
    print(bold(f"packed diffusion dataset {root}") + f": {len(ds)} packs of {capacity} latent tokens ({m['algorithm']}), "
          f"{len(m['packed_shards'])} shard(s), built from {len(m['source'])} raw shard(s)")
    if diff:
        print(f"  recipe: frames {diff.get('frames')}, max_pixels {diff.get('max_pixels')}, fps {diff.get('fps')}, "
              f"text_len {diff.get('text_len')}; vae {codecs.get('vae', {}).get('name')}, text encoder "
              f"{codecs.get('text_encoder', {}).get('name')}, patch {codecs.get('patch_size')}")
    print(f"  {clips:,} clips in {len(fills):,} packs; clips per pack {_dist(per_pack)}")
    total = sum(fills)
    print(f"  tokens per pack {_dist(fills)} of {capacity} capacity; fill {total:,}/{len(fills) * capacity:,} "
          f"({total / max(1, len(fills) * capacity):.2%})")
    print(f"  tokens per clip {_dist(tokens)}; frames {_counts(frames)}; height x width {_counts(sizes)}")
    print(f"  latents (dtype x channels C·p) {_counts(latent)}; text states width {_counts(text_width)}, "
          f"length {_dist(text_len)}")
    if images:
        print(f"  image-to-video: image conditioner {codecs.get('image_conditioner', {}).get('name')}; first-frame "
              f"features (tokens x width) {_counts(images)}")
    if s:
        dropped = s.get("dropped") or {}
        print(f"  clips packed {s.get('samples_packed', clips):,}/{s.get('samples', clips):,}, "
              f"dropped {s.get('dropped_total', sum(dropped.values())):,}")
        for reason, n in sorted(dropped.items()):
            print(f"    {reason:<28} {n:,}")
    print("  pack fill (% of capacity):")
    for row in text_histogram(np.asarray(fills) / capacity * 100, 0, 100, unit="%"):
        print("   " + row)
    picks = np.linspace(0, len(ds) - 1, min(show, len(ds))).round().astype(int).tolist() if show > 0 and len(ds) else []
    for i in picks:
        pack = ds[i]
        cu = pack["cu_seqlens"]
        print(bold(f"\npack {i}") + f": {int(cu[-1])}/{capacity} tokens, {len(pack['docs'])} clips")
        for d, (doc, arrays) in enumerate(zip(pack["docs"], pack["doc_arrays"])):
            grid = "x".join(str(int(g)) for g in arrays["grid"]) if "grid" in arrays else "?"
            clip = doc.get("clip") or {}
            size = f"{clip['height']}x{clip['width']}" if clip else "?"
            text = len(arrays["text"]) if "text" in arrays else "?"
            print(f"  clip {d}: {doc['id']}  grid {grid}  {int(cu[d + 1]) - int(cu[d])} tokens  "
                  f"{clip.get('frames', '?')} frames  {size}  text {text}")
    print(f"inspect: {len(ds)} packs, {clips:,} clips, {total:,}/{len(fills) * capacity:,} tokens")
    return 0
