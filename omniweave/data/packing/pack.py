"""``omniweave data pack``: raw shards -> packed dataset, in three restartable phases.

    scan   tokenize every sample (metadata only: vision / audio tokens from media headers)
           -> PACKED/scan/slice-IIIII-of-NNNNN.{npz,json}     (json written last = done)
    plan   global packing plan over all slices; stats.json, lengths.png
           -> PACKED/plan/plan.{npz,json}
    write  re-tokenize the samples of each pack and write packed shards
           -> PACKED/packs-SSSSSS.{bin,json}; manifest.json once every shard exists

``--phase all`` runs the three on one machine. On a cluster, array jobs run
``--phase scan --worker-index i --num-workers N``, one job runs ``--phase plan --num-workers N``,
then array jobs run ``--phase write --worker-index i --num-workers N`` (docs/packing.md). A phase
or shard whose done marker exists is never redone; a marker built with other settings is an error.

Media the recipe's model cannot consume are dropped at scan time with a counted reason, never
packed as bare text: with a ``model:`` section but no ``model.image_encoder``, samples with images
or videos are dropped as ``no_image_encoder``; without ``model.audio_encoder``, samples with audio
as ``no_audio_encoder``. Only the sections' presence counts (no model is built). A recipe without
any ``model:`` section (a data-only recipe) says nothing about the model: every modality is kept.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
from tqdm import tqdm

from omniweave.data.packing import bins as packing
from omniweave.data.packing.packed import (
    FORMAT, MANIFEST, PackedShardWriter, atomic_write_bytes, atomic_write_json, fingerprint_diff, pack_shard_name,
)
from omniweave.data.packing.stats import build_stats, plot_lengths
from omniweave.data.sources.shards import META_DIR
from omniweave.errors import UserError

SCAN_FIELDS = ("index", "length", "media", "vision", "images", "videos", "audios", "audio_tokens", "audio_samples",
               "audio_bytes", "truncated", "loss")
# model section -> the media kinds it consumes
ENCODER_MEDIA = {"image_encoder": ("image", "video"), "audio_encoder": ("audio",)}
DROP_REASONS = {"image": "no_image_encoder", "video": "no_image_encoder", "audio": "no_audio_encoder"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from omniweave.argtypes import integer

    p.add_argument("--input", required=True, help="raw shard directory (omniweave data convert output)")
    p.add_argument("--output", required=True, help="packed dataset directory")
    p.add_argument("--recipe", required=True, help="recipe YAML (its data: section) or built-in recipe name")
    p.add_argument("overrides", nargs="*", help="key=value recipe overrides, as for `omniweave train` (e.g. data.max_len=2048)")
    p.add_argument("--max-len", type=integer(1), default=None, help="pack capacity and max sample length (default data.max_len)")
    p.add_argument("--workers", type=integer(1), default=None,
                   help="processes on this machine (default: min(8, CPU cores); a diffusion recipe's write phase on "
                        "CUDA: one per GPU, worker k on GPU k mod the GPU count)")
    p.add_argument("--algorithm", choices=packing.ALGORITHMS, default="bfd")
    p.add_argument("--phase", choices=("scan", "plan", "write", "all"), default="all")
    p.add_argument("--worker-index", type=integer(0), default=0, help="this machine's slice (scan/write)")
    p.add_argument("--num-workers", type=integer(1), default=1, help="machines sharing scan/write (same value for plan)")
    p.add_argument("--packs-per-shard", type=integer(1), default=256)
    p.add_argument("--max-media-per-pack", type=integer(1), default=None)
    p.add_argument("--max-vision-tokens-per-pack", type=integer(1), default=None)
    p.add_argument("--device", default="auto",
                   help="diffusion recipes: where the VAE and text encoder run in the write phase (auto: cuda if any)")


def consumable_media(model_cfg: dict | None) -> list[str] | None:
    """The media kinds a recipe's ``model:`` section has encoders for; None without a model section."""
    if not model_cfg:
        return None
    return [kind for section, kinds in ENCODER_MEDIA.items() if model_cfg.get(section) for kind in kinds]


def data_config(recipe: str, max_len: int | None, overrides: list[str] = ()) -> tuple[dict, str, list[str] | None]:
    """(the recipe's ``data:`` section with ``key=value`` overrides, minus the loader-only keys;
    what to write: ``sft`` packs or RL ``prompts``, from its ``train.phase``; the media kinds its
    model consumes, ``consumable_media``)."""
    from omniweave.config import load_recipe, to_dict
    from omniweave.data.loading.loader import LOADER_ONLY_KEYS
    from omniweave.data.packing.prompts import dataset_kind

    cfg = to_dict(load_recipe(recipe, overrides))
    data = cfg.get("data") or {}
    for key in LOADER_ONLY_KEYS:
        data.pop(key, None)
    if max_len is not None:
        data["max_len"] = int(max_len)
    kind = dataset_kind((cfg.get("train") or {}).get("phase"))
    if kind == "diffusion":  # the recipe's VAE / text encoder / patch make the latents: part of the fingerprint
        from omniweave.diffusion.data import check_recipe, with_codecs

        check_recipe(cfg.get("model") or {}, "diffusion")
        return with_codecs(data, cfg["model"]), kind, None
    return data, kind, consumable_media(cfg.get("model"))


def _build_id(args, data_cfg: dict, fingerprint: dict, raw_shards: list[dict], kind: str,
              media_kinds: list[str] | None = None) -> dict:
    """What decides the output; every done marker stores it and a restart must match it."""
    return {
        "kind": kind, "fingerprint": fingerprint, "media_kinds": media_kinds,
        "algorithm": args.algorithm, "packs_per_shard": args.packs_per_shard,
        "max_media_per_pack": args.max_media_per_pack, "max_vision_tokens_per_pack": args.max_vision_tokens_per_pack,
        "num_workers": args.num_workers, "source": raw_shards,
    }


def _check_marker(path: Path, build: dict) -> bool:
    """True when ``path`` is a done marker of this build; raise when it belongs to another."""
    if not path.is_file():
        return False
    diffs = fingerprint_diff(json.loads(path.read_text())["build"], build, prefix="build")
    if diffs:
        raise UserError(f"{path} was made with other settings (use a new --output): " + "; ".join(diffs[:8]))
    return True


# ---------------------------------------------------------------------------- worker processes

_W: dict = {}


def _init_worker(raw_root: str, data_cfg: dict, kind: str, media_kinds: list[str] | None,
                 plan_file: str | None = None, device: str = "auto") -> None:
    from omniweave.data.sources.shards import RawDataset
    from omniweave.data.text.tokenize import SampleProcessor

    if kind == "vla":  # a LeRobot conversion: frames read as observation prompts (data/packing/vla.py)
        from omniweave.data.packing.vla import VLARawDataset, VLASettings

        _W["ds"] = VLARawDataset(raw_root, VLASettings.from_mapping(data_cfg.get("vla")))
    elif kind == "diffusion":  # a clips conversion: latents made in the write phase (diffusion/data.py)
        from omniweave.data.sources.clips_convert import ClipRawDataset
        from omniweave.diffusion.data import ClipEncoder, DiffusionSettings, codec_device

        _W["ds"] = ClipRawDataset(raw_root)
        settings = DiffusionSettings.from_mapping(data_cfg.get("diffusion"))
        codecs = data_cfg["diffusion"]["codecs"]
        _W["diffusion"] = (settings, tuple(codecs["patch_size"]))
        if plan_file:  # write only: the models, this worker's GPU among the machine's
            _W["encoder"] = ClipEncoder(codecs, settings, codec_device(device, _W.get("worker_index", 0)))
        else:
            _W["encoder"] = None
    else:
        _W["ds"] = RawDataset(raw_root)
    _W["proc"] = SampleProcessor(data_cfg)
    _W["kind"] = kind
    _W["media_kinds"] = media_kinds
    if plan_file:
        with np.load(plan_file, allow_pickle=False) as z:
            _W["plan"] = {k: z[k] for k in z.files}


def _init_pool_worker(threads: int, counter, *initargs) -> None:
    """A pool process: its index among the pool's (``counter``: each process takes the next; a
    diffusion write worker runs its codecs on GPU index mod the GPU count), its share of the cores
    as torch's intra-op threads (a write phase running the VAE in each of ``workers`` processes,
    each with every core's worth of OpenMP threads, spun and stalled: 128 demo clips packed in 130 s
    at 2 workers on 2 cores), then :func:`_init_worker`."""
    import torch

    with counter.get_lock():
        _W["worker_index"] = counter.value
        counter.value += 1
    torch.set_num_threads(threads)
    _init_worker(*initargs)


def _tokenize(raw) -> list[tuple]:
    """[(tokenized document, extra doc info)]: an SFT sample, an RL prompt with its answer, the
    two documents of a preference pair (packed as one item, so they stay together), a KTO
    completion or a VLA frame (its observation, its action chunk)."""
    from omniweave.data.packing.kto import tokenize_kto
    from omniweave.data.packing.pairs import tokenize_pair
    from omniweave.data.packing.prompts import KIND_KTO, KIND_PAIRS, KIND_PROMPTS, tokenize_rl_prompt
    from omniweave.data.text.tokenize import SampleRejected

    if _W["kind"] == "diffusion":
        from omniweave.diffusion.data import tokenize_clip

        return tokenize_clip(raw, *_W["diffusion"], _W["encoder"])
    conv, allowed = raw.conversation, _W["media_kinds"]
    heard = conv.videos if _W["proc"].audio.use_audio_in_video else []  # a video's sound track is audio too
    for kind, items in (("image", conv.images), ("video", conv.videos), ("audio", [*conv.audios, *heard])):
        if items and allowed is not None and kind not in allowed:
            raise SampleRejected(DROP_REASONS[kind], f"{len(items)} {kind} item(s); the model has no encoder for them")
    if _W["kind"] == KIND_PROMPTS:
        sample, answer = tokenize_rl_prompt(_W["proc"], raw)
        return [(sample, {"answer": answer})]
    if _W["kind"] == KIND_PAIRS:
        return tokenize_pair(_W["proc"], raw)
    if _W["kind"] == KIND_KTO:
        return tokenize_kto(_W["proc"], raw)
    if _W["kind"] == "vla":
        from omniweave.data.packing.vla import tokenize_vla

        return tokenize_vla(_W["proc"], raw)
    if conv.meta.get("kto_tag") is False:  # an undesirable answer is no SFT target (KTO trains on it)
        raise SampleRejected("kto_undesirable", "the row's KTO tag marks its answer undesirable")
    return [(_W["proc"].tokenize(raw), {})]


def _scan_range(bounds: tuple[int, int]) -> tuple[dict, dict]:
    from omniweave.data.text.tokenize import SampleRejected

    ds = _W["ds"]
    rows, rejects = [], {}
    for i in range(*bounds):
        try:
            raw = ds[i]
            docs = _tokenize(raw)
        except SampleRejected as e:
            rejects.setdefault(e.reason, []).append(i)
            continue
        except Exception as e:  # noqa: BLE001  (a broken sample is counted, never fatal)
            rejects.setdefault(f"unreadable:{type(e).__name__}", []).append(i)
            continue
        encoded = [m for s, info in docs if "same_media_as" not in info for m in s.media]  # a pair's media once
        audio = [m for m in encoded if m.kind == "audio"]
        rows.append((i, _planned_length(docs), len(encoded),
                     sum(m.length for s, _ in docs for m in s.media if m.kind != "audio"),
                     sum(m.kind == "image" for m in encoded), sum(m.kind == "video" for m in encoded), len(audio),
                     sum(m.length for s, _ in docs for m in s.media if m.kind == "audio"),
                     sum(m.num_samples for m in audio),
                     sum(len(raw.media[m.part]) for m in audio if m.part not in raw.conversation.videos),  # a video's sound: its bytes are the video's
                     int(any(s.truncated for s, _ in docs)), sum(int((s.labels != -100).sum()) for s, _ in docs)))
    arr = np.asarray(rows, dtype=np.int64).reshape(-1, len(SCAN_FIELDS))
    return {f: arr[:, k] for k, f in enumerate(SCAN_FIELDS)}, rejects


def _planned_length(docs: list[tuple]) -> int:
    """The tokens an item takes in its pack: its documents', twice for a KTO completion (the pack's
    KL documents: data/packing/kto.py)."""
    from omniweave.data.packing.kto import PLANNED_LENGTH_FACTOR
    from omniweave.data.packing.prompts import KIND_KTO

    return sum(len(s) for s, _ in docs) * (PLANNED_LENGTH_FACTOR if _W["kind"] == KIND_KTO else 1)


def _write_shard(shard: int) -> dict:
    ds, plan = _W["ds"], _W["plan"]
    out = Path(_W["out"])
    first, last = plan["shard_first"][shard], plan["shard_first"][shard + 1]
    writer = PackedShardWriter(out, shard)
    for k in range(first, last):
        docs = []
        for i in plan["items"][plan["offsets"][k] : plan["offsets"][k + 1]].tolist():
            raw = ds[i]
            item = _tokenize(raw)
            if _planned_length(item) != plan["length_of"][i]:
                raise RuntimeError(f"sample {i} tokenized to {_planned_length(item)} planned tokens, scanned as "
                                   f"{plan['length_of'][i]}")
            docs += [(sample, getattr(raw, "media", {}), {"index": i, "key": raw.key, **extra}) for sample, extra in item]
        if _W["kind"] == "kto":  # the pack's mismatched pairs for KTO's reference point, after its completions
            from omniweave.data.packing.kto import kl_documents

            docs += kl_documents(docs)
        writer.add(docs)
    return writer.close()


def _default_workers(kind: str, device: str = "cpu") -> int:
    """``--workers`` when not given: min(8, CPU cores); a diffusion write phase on CUDA one per GPU
    (each worker holds the VAE and text encoder -- an fp32 umT5-XXL is ~23 GB -- on its own GPU; an
    explicit ``--device cuda:N``: one). ``torch.cuda.device_count`` asks NVML, so the pool forked
    after it can still use CUDA."""
    cpus = min(8, os.cpu_count() or 1)
    if kind != "diffusion" or device == "cpu":
        return cpus
    if device.startswith("cuda:"):
        return 1
    import torch

    return torch.cuda.device_count() or cpus  # auto without a GPU: the codecs run on the CPU


def _pool_map(fn, tasks: list, workers: int, initargs: tuple, desc: str, weights=None):
    """Ordered results of fn over tasks, in ``workers`` processes, with a progress bar."""
    bar = tqdm(total=sum(weights) if weights else len(tasks), desc=desc, unit="sample" if weights else "task",
               dynamic_ncols=True, file=sys.stderr, disable=None)  # None: drawn on a terminal only, never into logs
    results = []
    if workers <= 1 or len(tasks) <= 1:
        _init_worker(*initargs)
        it = map(fn, tasks)
        pool = None
    else:
        n, ctx = min(workers, len(tasks)), mp.get_context("fork")
        pool = ctx.Pool(n, _init_pool_worker, (max(1, (os.cpu_count() or 1) // n), ctx.Value("i", 0), *initargs))
        it = pool.imap(fn, tasks)
    try:
        for k, r in enumerate(it):
            results.append(r)
            bar.update(weights[k] if weights else 1)
    finally:
        bar.close()
        if pool is not None:
            pool.close()
            pool.join()
    return results


# ---------------------------------------------------------------------------- phases

def scan_phase(args, out: Path, data_cfg: dict, build: dict, n_raw: int) -> Path:
    N, i = args.num_workers, args.worker_index
    marker = out / "scan" / f"slice-{i:05d}-of-{N:05d}.json"
    if _check_marker(marker, build):
        print(f"scan: slice {i}/{N} already done ({marker})", file=sys.stderr)
        return marker
    lo, hi = i * n_raw // N, (i + 1) * n_raw // N
    workers = args.workers or _default_workers(build["kind"])
    step = max(1, min(256, (hi - lo) // max(1, 4 * workers) or 1))
    chunks = [(a, min(a + step, hi)) for a in range(lo, hi, step)]
    results = _pool_map(_scan_range, chunks, workers, (args.input, data_cfg, build["kind"], build["media_kinds"]),
                        f"scan {i}/{N}",
                        weights=[b - a for a, b in chunks])
    arrays = {f: np.concatenate([r[0][f] for r in results]) if results else np.zeros(0, np.int64) for f in SCAN_FIELDS}
    rejects: dict[str, list[int]] = {}
    for _, rj in results:
        for reason, idx in rj.items():
            rejects.setdefault(reason, []).extend(idx)
    marker.parent.mkdir(parents=True, exist_ok=True)
    npz = marker.with_suffix(".npz")
    with open(npz.with_name(npz.name + ".tmp"), "wb") as f:
        np.savez(f, **arrays)
    os.replace(npz.with_name(npz.name + ".tmp"), npz)
    atomic_write_json(marker, {"build": build, "range": [lo, hi], "accepted": int(len(arrays["index"])),
                               "rejected": {k: len(v) for k, v in rejects.items()}, "rejected_samples": rejects})
    return marker


def plan_phase(args, out: Path, build: dict, n_raw: int) -> dict:
    marker = out / "plan" / "plan.json"
    if _check_marker(marker, build):
        print(f"plan: already done ({marker})", file=sys.stderr)
        return json.loads(marker.read_text())
    N = args.num_workers
    missing = [k for k in range(N) if not (out / "scan" / f"slice-{k:05d}-of-{N:05d}.json").is_file()]
    if missing:
        raise UserError(f"plan: scan slices {missing} of {N} are not done yet (run --phase scan --worker-index K)")
    scan = {f: [] for f in SCAN_FIELDS}
    rejects: Counter = Counter()
    for k in range(N):
        m = out / "scan" / f"slice-{k:05d}-of-{N:05d}.json"
        _check_marker(m, build)
        rejects.update(json.loads(m.read_text())["rejected"])
        with np.load(m.with_suffix(".npz"), allow_pickle=False) as z:
            for f in SCAN_FIELDS:
                scan[f].append(z[f])
    scan = {f: np.concatenate(v) for f, v in scan.items()}
    scan["total"] = n_raw
    t0 = time.perf_counter()
    capacity = int(build["fingerprint"]["max_len"])
    plan = packing.pack(scan["length"], capacity, args.algorithm, media=scan["media"], vision=scan["vision"],
                        max_media=args.max_media_per_pack, max_vision=args.max_vision_tokens_per_pack)
    plan_s = time.perf_counter() - t0
    drop_reason = "exceeds_pack_caps" if len(plan.dropped) else None
    pack_drops = Counter({drop_reason: len(plan.dropped)}) if drop_reason else Counter()
    stats = build_stats(scan, plan, rejects, pack_drops, args.algorithm)
    stats["plan_seconds"] = round(plan_s, 3)
    pps = args.packs_per_shard
    shard_first = np.r_[np.arange(0, plan.num_packs, pps), plan.num_packs].astype(np.int64)
    length_of = np.zeros(n_raw, np.int64)
    length_of[scan["index"]] = scan["length"]
    (out / "plan").mkdir(parents=True, exist_ok=True)
    npz = out / "plan" / "plan.npz"
    with open(npz.with_name("plan.npz.tmp"), "wb") as f:
        np.savez(f, items=scan["index"][plan.items], offsets=plan.offsets, shard_first=shard_first, length_of=length_of)
    os.replace(npz.with_name("plan.npz.tmp"), npz)
    atomic_write_json(out / "stats.json", stats)
    plot_lengths(out / "lengths.png", scan["length"][plan.items], plan.fills(scan["length"]), capacity,
                 f"{stats['samples_packed']} samples -> {plan.num_packs} packs, efficiency {stats['efficiency']:.2%}")
    info = {"build": build, "num_packs": plan.num_packs, "num_shards": len(shard_first) - 1, "stats": "stats.json"}
    atomic_write_json(marker, info)
    return info


def write_phase(args, out: Path, data_cfg: dict, build: dict, info: dict) -> list[int]:
    N, i = args.num_workers, args.worker_index
    mine = [s for s in range(info["num_shards"]) if s % N == i]
    workers = args.workers or _default_workers(build["kind"], getattr(args, "device", "auto"))
    todo = [s for s in mine if not (out / f"{pack_shard_name(s)}.json").is_file()]
    if len(todo) < len(mine):
        print(f"write: {len(mine) - len(todo)} of {len(mine)} shards already done", file=sys.stderr)
    if todo:
        _W["out"] = str(out)
        _pool_map(_write_shard, todo, workers,
                  (args.input, data_cfg, build["kind"], build["media_kinds"], str(out / "plan" / "plan.npz"),
                   getattr(args, "device", "auto")),
                  f"write {i}/{N}")
    return todo


def maybe_finish(out: Path, data_cfg: dict, build: dict, info: dict) -> bool:
    """Write manifest.json once every packed shard is on disk (any worker may be the last)."""
    names = [pack_shard_name(s) for s in range(info["num_shards"])]
    if not all((out / f"{n}.json").is_file() for n in names):
        return False
    shards = []
    for n in names:
        idx = json.loads((out / f"{n}.json").read_text())
        shards.append({"name": n, "packs": len(idx["packs"]), "bytes": idx["bytes"]})
    atomic_write_json(out / MANIFEST, {
        "format": FORMAT, "kind": build["kind"], "fingerprint": build["fingerprint"], "data_cfg": data_cfg,
        "algorithm": build["algorithm"], "capacity": int(build["fingerprint"]["max_len"]),
        "caps": {"max_media": build["max_media_per_pack"], "max_vision_tokens": build["max_vision_tokens_per_pack"]},
        "num_packs": sum(s["packs"] for s in shards), "source": build["source"], "packed_shards": shards,
    })
    return True


def run(args) -> int:
    from omniweave.data.sources.shards import RawDataset
    from omniweave.data.text.tokenize import SampleProcessor

    if not 0 <= args.worker_index < args.num_workers:
        raise UserError(f"--worker-index {args.worker_index} must be in [0, --num-workers {args.num_workers})")
    if args.phase == "all" and args.num_workers != 1:
        raise UserError("--phase all runs on one machine; with --num-workers N run scan, plan, write separately")
    t0 = time.time()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    data_cfg, kind, media_kinds = data_config(args.recipe, args.max_len, args.overrides)
    if kind == "prompts":  # RL prompts: each is its own pack, handed out one by one
        args.algorithm = "single"
    if not (Path(args.input) / META_DIR).is_dir():
        raise UserError(f"--input {args.input}: not a raw dataset (no {META_DIR}/); make one with "
                        "`omniweave data convert --input F.jsonl --output RAW`")
    from omniweave.data.packing.vla import check_raw_kind

    check_raw_kind(args.input, kind)
    if kind == "vla":  # the policy undoes the normalisation from the packed dataset's copy (vla/policy.py)
        from omniweave.data.packing.vla import STATS_FILE

        atomic_write_bytes(out / STATS_FILE, (Path(args.input) / STATS_FILE).read_bytes())
    fingerprint = SampleProcessor(data_cfg).fingerprint()
    raw = RawDataset(args.input)
    source = [{"name": s.name, "count": s.count, "bytes": s.bytes} for s in raw.shards]
    build = _build_id(args, data_cfg, fingerprint, source, kind, media_kinds)
    if args.phase in ("scan", "all"):
        scan_phase(args, out, data_cfg, build, len(raw))
    if args.phase in ("plan", "all"):
        plan_phase(args, out, build, len(raw))
    if args.phase in ("write", "all"):
        marker = out / "plan" / "plan.json"
        if not _check_marker(marker, build):
            raise UserError(f"write: {marker} missing; run --phase plan first")
        info = json.loads(marker.read_text())
        write_phase(args, out, data_cfg, build, info)
        if maybe_finish(out, data_cfg, build, info):
            s = json.loads((out / "stats.json").read_text())
            if not s["packs"]:  # training would have nothing to read: say why now
                reasons = ", ".join(f"{k}: {v}" for k, v in (s["dropped"] or {}).items()) or "no samples in the input"
                raise UserError(f"no sample could be packed ({reasons}); the counts are in {out / 'stats.json'}")
            if kind == "prompts":  # one prompt per pack: fill is not a goal here
                print(f"packed {s['samples_packed']}/{s['samples']} RL prompts (one per pack, at most "
                      f"{s['capacity']} tokens), dropped {s['dropped'] or 0} -> {out} ({time.time() - t0:.1f}s)")
            else:
                what = ("preference pairs (2 documents each, kept together)" if kind == "pairs" else
                        "KTO completions (and as many KL documents)" if kind == "kto" else
                        "robot frames (observation + action chunk)" if kind == "vla" else
                        "video clips (VAE latents + text states)" if kind == "diffusion" else "samples")
                print(f"packed {s['samples_packed']}/{s['samples']} {what} into {s['packs']} packs of {s['capacity']} "
                      f"tokens, efficiency {s['efficiency']:.2%}, dropped {s['dropped'] or 0} -> {out} "
                      f"({time.time() - t0:.1f}s)")
            return 0
        print(f"write {args.worker_index}/{args.num_workers}: done; other slices still pending ({time.time() - t0:.1f}s)")
        return 0
    print(f"{args.phase} {args.worker_index}/{args.num_workers}: done -> {out} ({time.time() - t0:.1f}s)")
    return 0
