"""``omniweave data convert``: conversations (JSON / JSONL) + media files -> raw shards.

    omniweave data convert --input train.jsonl --media-dir media/ --output RAW \
        [--maxcount N] [--maxsize BYTES] [--workers W] [--strict] [--format F] [--mapping YAML]
        [--max-media-size BYTES] [--max-image-pixels N]
    omniweave data convert --dataset-info data/dataset_info.json --dataset a,b --output RAW   (LLaMA-Factory's
        registry: each entry's files with its own formatting / columns / tags, data/sources/dataset_info.py)
    omniweave data convert --format lerobot --input DATASET_DIR --output RAW [--horizon H] [--stride S]
        (a LeRobot v3.0 dataset -> one VLA sample per frame: data/sources/lerobot_convert.py)
    omniweave data convert --format clips --input rows.jsonl [...] [--media-dir DIR] --output RAW
        (caption + video / image rows, text-to-video diffusion -> one clip sample per row, media bytes
        unchanged: data/sources/clips_convert.py)

Every input row is either written (sample key ``s{global_row:09d}``, the row's 0-based position
across all inputs) or rejected with a reason into ``RAW/rejects.jsonl``; ``RAW/convert_report.json``
holds the counts (``input == written + rejected``). Media bytes are copied unchanged, after a
check (``media_files``: a regular file inside the media dir; an image fully decoded, the PyAV stream
header for videos, ``probe_audio`` for audio: wav, flac, mp3, m4a/aac, ogg); a ``data:`` URL's bytes
are stored as a file like any other.

Parallelism and crash safety: rows are cut into blocks of ``--maxcount`` consecutive rows; each
block is one job that a worker turns into shard(s) under ``RAW/.work/`` (temporary name, renamed
when whole, then a ``job-J.done.json`` marker). When every job is done the shards are renamed to
``RAW/shard-NNNNNN.tar`` in row order and the Energon metadata is written. The result does not
depend on ``--workers``. A killed run leaves no ``shard-*.tar`` that is incomplete; rerunning the
same command reuses the finished jobs and redoes the rest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from omniweave.data.sources import dataset_info as registry
from omniweave.data.sources import lerobot_convert
from omniweave.data.sources import shards as sh
from omniweave.data.sources.formats import FormatError, decode_row, parse_row
from omniweave.data.sources.mapping import COLUMN_FIELDS, FORMATS, TAG_FIELDS, Mapping, detect_format, mapping_from_yaml
from omniweave.data.media.vision import DEFAULT_MAX_IMAGE_PIXELS, IMAGE_PIXELS_CEILING
from omniweave.data.media.files import DEFAULT_MAX_MEDIA_BYTES, MediaLimits, load_media, media_extension, source_name
from omniweave.data.sources.preference import REJECT_REASONS as PREFERENCE_REJECTS
from omniweave.data.sources.preference import from_conversation_pair, is_preference_row, split_preference_row

# the fixed reasons; parameterised ones are "unsupported_modality:<kind>", "unknown_content_part:<type>",
# "unknown_media_column:<column>" (docs/data.md, "Reject reasons")
REJECT_REASONS = (
    "malformed_json", "bad_json", "bad_text", "bad_schema", "missing_media", "unreadable_media", "undecodable_media",
    "placeholder_mismatch", "empty_conversation", "no_assistant_turn", "unknown_role", "bad_turn_order",
    "media_path_escapes", "absolute_path_outside", "not_a_regular_file", "media_too_large", "image_too_large",
    "bad_data_url",
    # audio whose header does not read (audio.probe_audio's MediaError reasons)
    "not_audio", "no_audio_stream", "empty_audio", "audio_truncated", "bad_audio",
    *PREFERENCE_REJECTS,  # preference pairs: a missing side, identical sides (data/sources/preference.py)
)
KILL_ENV = "OMNIWEAVE_TEST_KILL_AFTER_ROWS"  # tests: a worker os._exit()s after this many rows


def parse_size(text: str) -> int:
    """``123``, ``64K``, ``100M``, ``2G`` -> bytes."""
    text = str(text).strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from omniweave.argtypes import integer

    p.add_argument("--input", nargs="+", help="JSON / JSONL file(s) of conversations (--format lerobot: a dataset dir)")
    p.add_argument("--dataset-info", metavar="PATH", help="a LLaMA-Factory dataset_info.json (instead of --input and "
                   "the mapping flags): convert the --dataset entries, each with its own formatting/columns/tags")
    p.add_argument("--dataset", metavar="NAME[,NAME...]", help="the --dataset-info entries to convert into one output")
    p.add_argument("--media-dir", help="root that media paths are relative to (default: the input's folder, or "
                   "the dataset_info.json's)")
    p.add_argument("--output", required=True, help="raw dataset directory to write")
    p.add_argument("--maxcount", type=integer(1), default=1000, help="rows per job; a shard holds at most this many samples")
    p.add_argument("--maxsize", type=parse_size, default=parse_size("1G"), help="start a new shard past this size (e.g. 512M)")
    p.add_argument("--workers", type=integer(1), default=min(4, os.cpu_count() or 1), help="worker processes")
    p.add_argument("--max-media-size", type=parse_size, default=DEFAULT_MAX_MEDIA_BYTES,
                   help="reject a media file larger than this (media_too_large; e.g. 256M)")
    p.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                   help=f"reject an image or video frame with more pixels (image_too_large; at most {IMAGE_PIXELS_CEILING})")
    p.add_argument("--strict", action="store_true", help="exit non-zero if any row is rejected")
    p.add_argument("--format", choices=("auto", *FORMATS, "lerobot", "clips"), default="auto")
    lerobot_convert.add_arguments(p)
    p.add_argument("--mapping", help="YAML with formatting/columns/tags (LLaMA-Factory dataset_info style)")
    p.add_argument("--auto-placeholders", action="store_true",
                   help="rows with media but no <image>/<video>/<audio> at all get them prepended to the first "
                   "user turn")
    for name in COLUMN_FIELDS:  # dest: `--input-key` must not overwrite `--input`
        p.add_argument(f"--{name.replace('_', '-')}-key", dest=f"{name}_key", metavar="COLUMN",
                       help=f"column holding the {name} (remap)")
    tag_help = {
        "role_tag": "key of a turn's role (openai: role, sharegpt: from)",
        "content_tag": "key of a turn's text (openai: content, sharegpt: value)",
        "user_tag": "role value of user turns (human)", "assistant_tag": "role value of assistant turns (gpt)",
        "system_tag": "role value of system turns (system)",
        "observation_tag": "role value of tool results (openai: tool, sharegpt: observation)",
        "function_tag": "role value of tool calls (openai: function, sharegpt: function_call)",
    }
    for name in TAG_FIELDS:
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, metavar="NAME", help=tag_help[name])
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


# ---------------------------------------------------------------------------- reading rows


@dataclass
class Row:
    file: str  # input file name as given
    index: int  # 0-based row index within the file
    line: int | None  # 1-based line number (JSONL)
    raw: object  # JSONL: the line's text (parsed in the worker; bytes if not UTF-8); JSON: the parsed object
    dataset: str | None = None  # its --dataset-info entry


def read_rows(path: str, dataset: str | None = None) -> list[Row]:
    data = Path(path).read_bytes()
    if not path.endswith(".jsonl") and data.lstrip().startswith(b"{") and data.count(b"\n") > 1:
        try:  # a pretty-printed single object is not JSONL
            single = json.loads(data)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deep: read as JSONL
            single = None
        if isinstance(single, dict):
            raise SystemExit(f"{path}: a .json input must hold a list of conversations (or use JSONL)")
    if path.endswith(".jsonl") or not data.lstrip().startswith(b"["):
        rows = []
        for n, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            try:
                text: str | bytes = line.decode("utf-8")
            except UnicodeDecodeError:
                text = line  # bytes: rejected as malformed_json by the worker
            rows.append(Row(path, len(rows), n, text, dataset))
        return rows
    try:
        parsed = json.loads(data)
    except (ValueError, RecursionError) as e:  # not JSON / not UTF-8 / a row nested past Python's recursion limit
        raise SystemExit(f"{path} is not valid JSON ({e}); one bad row in a JSON array makes the whole "
                         "file unreadable, JSONL keeps going") from e
    if not isinstance(parsed, list):
        raise SystemExit(f"{path}: a .json input must hold a list of conversations, got {type(parsed).__name__}")
    return [Row(path, i, None, obj, dataset) for i, obj in enumerate(parsed)]


def build_mapping(args) -> Mapping:
    base = Mapping(format=None if args.format == "auto" else args.format)
    if args.mapping:
        base = mapping_from_yaml(args.mapping, base)
    flags = {k: getattr(args, k) for k in TAG_FIELDS if getattr(args, k, None) is not None}
    flags.update({k: getattr(args, f"{k}_key") for k in COLUMN_FIELDS if getattr(args, f"{k}_key", None) is not None})
    return replace(base, **flags)


def resolve_mapping(rows: list[Row], mapping: Mapping) -> Mapping:
    sample = []
    for row in rows[:64]:
        try:
            sample.append(from_conversation_pair(decode_row(row.raw)))
        except FormatError:  # rejected with its reason when the row is converted
            continue
    return mapping.resolved(detect_format(sample, mapping))


def read_sources(args, datasets: list | None) -> tuple[list[Row], dict, dict]:
    """(rows in order, (dataset, file) -> Mapping, (dataset, file) -> media dir): from --input files
    (one mapping from the flags, its format detected per file) or from registry entries."""
    if datasets is None:
        base = build_mapping(args)
        rows_by_file = {f: read_rows(f) for f in args.input}
        mappings = {(None, f): resolve_mapping(rows, base) for f, rows in rows_by_file.items()}
        media_dirs = {(None, f): args.media_dir or str(Path(f).parent) for f in args.input}
        return [r for f in args.input for r in rows_by_file[f]], mappings, media_dirs
    rows, mappings, media_dirs = [], {}, {}
    for ds in datasets:
        for f in ds.files:
            rows += read_rows(f, ds.name)
            mappings[(ds.name, f)], media_dirs[(ds.name, f)] = ds.mapping, args.media_dir or ds.root
    return rows, mappings, media_dirs


# ---------------------------------------------------------------------------- one row


def convert_row(row: Row, mapping: Mapping, media_dir: str, auto_placeholders: bool, limits: MediaLimits):
    """-> (Conversation with part names, media dict); raises FormatError."""
    raw = from_conversation_pair(decode_row(row.raw))
    stem = Path(row.file).stem
    rejected = None
    if is_preference_row(raw, mapping):  # a DPO pair: prompt + chosen answer, the rejected answer in meta
        raw, rejected = split_preference_row(raw, mapping)
    conv = parse_row(raw, mapping, row_id=f"{stem}-{row.index}", auto_placeholders=auto_placeholders)
    if rejected is not None:
        conv.meta["rejected"] = rejected
    media: dict[str, bytes] = {}
    names = {"image": [], "video": [], "audio": []}
    sources = (("image", conv.images, "img"), ("video", conv.videos, "vid"), ("audio", conv.audios, "aud"))
    for kind, paths, prefix in sources:
        for i, path in enumerate(paths):
            name = f"{prefix}{i}.{media_extension(path)}"
            media[name] = load_media(path, media_dir, kind, limits)
            names[kind].append(name)
    conv.meta = {"source": Path(row.file).name, "index": row.index, **({"dataset": row.dataset} if row.dataset else {}),
                 "source_images": conv.images, "source_videos": conv.videos,
                 **({"source_audios": [source_name(p) for p in conv.audios]} if conv.audios else {}), **conv.meta}
    conv.images, conv.videos, conv.audios = names["image"], names["video"], names["audio"]
    return conv, media


# ---------------------------------------------------------------------------- one job (a block of rows)


@dataclass
class Job:
    number: int
    first: int  # global index of the first row
    rows: list[Row]
    mappings: dict  # (dataset, file) -> Mapping
    media_dirs: dict  # (dataset, file) -> media dir
    work: str
    maxcount: int
    maxsize: int
    auto_placeholders: bool
    limits: MediaLimits


_rows_done_in_process = 0


def run_job(job: Job) -> dict:
    """Write the job's shards into the work dir; returns its done-record (also saved as JSON)."""
    global _rows_done_in_process
    kill_after = int(os.environ.get(KILL_ENV, "0") or 0)
    work = Path(job.work)
    records, rejects = [], []
    writer = None
    media_bytes = 0
    media_items: Counter = Counter()  # stored items per modality
    unused: dict[str, Counter] = {}  # file -> unmapped column -> rows holding it (written rows only)

    def close_writer():
        nonlocal writer
        if writer is not None and writer.count:
            final = work / f"job-{job.number:06d}-{len(records):03d}.tar"
            records.append(sh.finalize_shard(writer, final))
        elif writer is not None:
            writer.abort()
        writer = None

    for offset, row in enumerate(job.rows):
        g = job.first + offset
        try:
            source = (row.dataset, row.file)
            conv, media = convert_row(row, job.mappings[source], job.media_dirs[source], job.auto_placeholders, job.limits)
        except FormatError as e:
            rejects.append({"row": g, **({"dataset": row.dataset} if row.dataset else {}), "file": row.file,
                            "index": row.index, "line": row.line, "reason": e.reason, "message": e.message})
        else:
            if writer is not None and writer.size >= job.maxsize:
                close_writer()
            if writer is None:
                writer = sh.ShardWriter(work / f"job-{job.number:06d}-{len(records):03d}.tar.tmp")
            sh.write_conversation_sample(writer, sh.sample_key(g), conv, media)
            media_bytes += sum(len(b) for b in media.values())
            media_items.update(image=len(conv.images), video=len(conv.videos), audio=len(conv.audios))
            if conv.meta.get("extra"):
                unused.setdefault(row.file, Counter()).update(conv.meta["extra"].keys())
        _rows_done_in_process += 1
        if kill_after and _rows_done_in_process >= kill_after:
            os._exit(17)  # simulate a crash mid-shard (test hook)
    close_writer()
    done = {"job": job.number, "rows": len(job.rows), "shards": records, "rejects": rejects, "media_bytes": media_bytes,
            "media_items": dict(media_items), "unused_columns": {f: dict(c) for f, c in unused.items()}}
    tmp = work / f"job-{job.number:06d}.done.json.tmp"
    tmp.write_text(json.dumps(done))
    os.replace(tmp, work / f"job-{job.number:06d}.done.json")
    return done


# ---------------------------------------------------------------------------- the command


def _fingerprint(args, files: list[str]) -> str:
    spec = {
        "inputs": [(f, os.path.getsize(f), os.path.getmtime(f)) for f in files],
        "mapping": Path(args.mapping).read_text() if args.mapping else None,
        "dataset_info": Path(args.dataset_info).read_text() if args.dataset_info else None,  # the entries
        "args": {k: v for k, v in sorted(vars(args).items()) if k not in ("workers", "no_progress", "strict")},
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _clear_output(out: Path, keep_work: bool) -> None:
    """Remove what a previous convert wrote (only our own files)."""
    for pattern in ("shard-*.tar", "shard-*.tar.idx", "rejects.jsonl", "convert_report.json"):
        for p in out.glob(pattern):
            p.unlink()
    shutil.rmtree(out / sh.META_DIR, ignore_errors=True)
    if not keep_work:
        shutil.rmtree(out / ".work", ignore_errors=True)


def run(args) -> int:
    if args.format == "lerobot":
        return lerobot_convert.run(args)
    if args.format == "clips":
        from omniweave.data.sources import clips_convert

        return clips_convert.run(args)
    lerobot_convert.refuse_lerobot_flags(args)
    t0 = time.perf_counter()
    out = Path(args.output)
    registry.check_flags(args)
    datasets = registry.select(args.dataset_info, args.dataset) if args.dataset_info else None
    files = [f for ds in datasets for f in ds.files] if datasets else list(args.input)
    if not 0 < args.max_image_pixels <= IMAGE_PIXELS_CEILING or args.max_media_size <= 0:
        print(f"omniweave data convert: --max-image-pixels must be in 1..{IMAGE_PIXELS_CEILING} (training decodes "
              "up to that) and --max-media-size positive", file=sys.stderr)
        return 2
    for f in files:
        if not Path(f).is_file():
            print(f"omniweave data convert: input {f} not found", file=sys.stderr)
            return 2
    try:
        rows, mappings, media_dirs = read_sources(args, datasets)
    except (ValueError, SystemExit) as e:
        print(f"omniweave data convert: {e}", file=sys.stderr)
        return 2

    out.mkdir(parents=True, exist_ok=True)
    work = out / ".work"
    fp = _fingerprint(args, files)
    previous = (work / "run.json").is_file() and json.loads((work / "run.json").read_text()).get("fingerprint") == fp
    _clear_output(out, keep_work=previous)
    work.mkdir(exist_ok=True)
    (work / "run.json").write_text(json.dumps({"fingerprint": fp}))
    for stale in work.glob("*.tmp*"):
        stale.unlink()

    B = max(1, args.maxcount)
    limits = MediaLimits(args.max_media_size, args.max_image_pixels)
    jobs = [
        Job(j, j * B, rows[j * B:(j + 1) * B], mappings, media_dirs, str(work), B, args.maxsize, args.auto_placeholders,
            limits)
        for j in range((len(rows) + B - 1) // B)
    ]
    done: dict[int, dict] = {}
    for job in jobs:  # resume: finished jobs of an interrupted run with the same inputs and flags
        marker = work / f"job-{job.number:06d}.done.json"
        if marker.is_file():
            rec = json.loads(marker.read_text())
            if all((work / s["name"]).is_file() for s in rec["shards"]):
                done[job.number] = rec
    todo = [job for job in jobs if job.number not in done]

    from tqdm import tqdm

    import PIL.Image  # noqa: F401 - imported once here so forked workers inherit it
    if rows:
        import av  # noqa: F401

    tqdm.monitor_interval = 0  # no monitor thread in a process that forks workers
    bar = tqdm(total=len(rows), initial=sum(d["rows"] for d in done.values()), unit="row", desc="convert",
               disable=args.no_progress or None, dynamic_ncols=True)
    try:
        if args.workers <= 1 or len(todo) <= 1:
            for job in todo:
                done[job.number] = run_job(job)
                bar.update(len(job.rows))
        else:
            from concurrent.futures import as_completed

            with ProcessPoolExecutor(max_workers=min(args.workers, len(todo))) as pool:
                futures = {pool.submit(run_job, job): job for job in todo}
                for fut in as_completed(futures):
                    rec = fut.result()
                    done[rec["job"]] = rec
                    bar.update(rec["rows"])
    except Exception as e:  # noqa: BLE001 - e.g. BrokenProcessPool when a worker dies
        bar.close()
        print(f"omniweave data convert: failed ({type(e).__name__}: {e}); rerun the same command to resume", file=sys.stderr)
        return 1
    bar.close()
    return _finish(args, out, work, jobs, done, files, datasets, t0)


def _finish(args, out: Path, work: Path, jobs: list[Job], done: dict, files: list[str], datasets: list | None,
            t0: float) -> int:
    n_rows = sum(len(job.rows) for job in jobs)
    shard_records, rejects, media_bytes = [], [], 0
    media_items = Counter({"image": 0, "video": 0, "audio": 0})
    unused: dict[str, Counter] = {}
    for job in jobs:
        rec = done[job.number]
        media_bytes += rec["media_bytes"]
        media_items.update(rec.get("media_items", {}))
        for file, columns in rec.get("unused_columns", {}).items():
            unused.setdefault(file, Counter()).update(columns)
        rejects.extend(rec["rejects"])
        for s in rec["shards"]:
            name = sh.shard_name(len(shard_records))
            src, dst = work / s["name"], out / name
            os.replace(src.with_name(src.name + ".idx"), dst.with_name(name + ".idx"))
            os.replace(src, dst)
            shard_records.append({**s, "name": name})
    sh.write_metadata(out, shard_records)
    with open(out / "rejects.jsonl", "w") as f:
        for r in rejects:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    written = sum(s["count"] for s in shard_records)
    by_reason = dict(sorted(Counter(r["reason"] for r in rejects).items()))
    total_bytes = sum(s["bytes"] for s in shard_records)
    seconds = time.perf_counter() - t0
    report = {
        "kind": "conversation", "input": n_rows, "written": written, "rejected": len(rejects), "rejected_by_reason": by_reason,
        "bytes": total_bytes, "media_bytes": media_bytes, "media_items": dict(media_items),
        "unused_columns": {f: dict(sorted(c.items())) for f, c in unused.items()}, "seconds": round(seconds, 3),
        "inputs": files, "workers": args.workers, "maxcount": args.maxcount, "maxsize": args.maxsize,
        "shards": [{"name": s["name"], "count": s["count"], "bytes": s["bytes"]} for s in shard_records],
    }
    if datasets:
        report.update(dataset_info=str(args.dataset_info), datasets=registry.per_dataset(
            datasets, Counter(r.dataset for job in jobs for r in job.rows), rejects))
    assert n_rows == written + len(rejects), "row accounting is broken"
    (out / "convert_report.json").write_text(json.dumps(report, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    for file, columns in unused.items():
        print(f"convert: warning: {file}: column(s) no mapping reads: "
              + ", ".join(f"'{c}' ({n} rows)" for c, n in sorted(columns.items()))
              + "; they are kept in each sample's meta.extra but not trained on. If one holds turns, a system "
              "prompt or media, map it (" + ("the entry's columns in --dataset-info" if datasets else "--messages-key, "
              "--system-key, --images-key, --videos-key, --audios-key or --mapping") + ")",
              file=sys.stderr)
    reasons = ", ".join(f"{k}: {v}" for k, v in by_reason.items())
    stored = ", ".join(f"{n} {kind}(s)" for kind, n in media_items.items())
    print(
        f"convert: {n_rows} rows -> {written} samples in {len(shard_records)} shard(s) ({total_bytes / 1e6:.1f} MB), "
        f"media: {stored}, "
        f"{len(rejects)} rejected{f' ({reasons})' if reasons else ''} in {seconds:.1f}s -> {out}"
        + (f"; see {out / 'rejects.jsonl'}" if rejects else "")
    )
    if datasets:
        print("convert: per dataset: " + ", ".join(f"{name} {d['input']} -> {d['written']}"
                                                   for name, d in report["datasets"].items()))
    if n_rows and not written:  # nothing to pack: a mapping or media-dir mistake, not a dataset
        print(f"omniweave data convert: error: every row was rejected ({reasons}); the first few reasons with their "
              f"rows are in {out / 'rejects.jsonl'}", file=sys.stderr)
        return 1
    return 1 if args.strict and rejects else 0
