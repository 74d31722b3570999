"""Human summary of a packed dataset: efficiency, fill histogram, and one pack rendered as text
with ``<image×N>`` / ``<video×N>`` / ``<audio×N>`` markers (one per run of pads: an audio clip
shows one marker per encoder item) and the loss-carrying tokens highlighted
(green with ANSI colour, ``[[…]]`` without). ``omniweave data inspect PACKED`` dispatches here."""

from __future__ import annotations

import json
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


def inspect_packed(root, color: bool, pack_id: int = 0) -> int:
    from omniweave.data.text.tokenizer import load_tokenizer

    root = Path(root)
    ds = PackedDataset(root)
    m = ds.manifest
    stats_file = root / "stats.json"
    s = json.loads(stats_file.read_text()) if stats_file.is_file() else {}
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
