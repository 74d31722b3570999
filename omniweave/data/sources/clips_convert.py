"""``omniweave data convert --format clips``: caption + video / image rows -> raw clip shards.

    omniweave data convert --format clips --input train.jsonl [more.jsonl ...] [--media-dir DIR] --output RAW \
        [--maxcount N] [--maxsize BYTES] [--max-media-size BYTES] [--max-image-pixels N] [--strict] [--no-progress]

Input: JSON arrays or JSONL files of rows ``{"caption": str, "video": PATH}`` or ``{"caption": str,
"image": PATH}`` (exactly one of the two), optionally ``"id"`` (a string or an integer; without it
the row's 0-based position across all inputs). PATH is relative to ``--media-dir`` (default: the
input file's folder) or absolute. Other keys are ignored. ``omniweave.diffusion.demo_data``'s
``train.jsonl`` converts as is.

Every row is written or rejected with a reason (``REJECT_REASONS``): ``bad_json`` (a line that is not
JSON / not UTF-8), ``bad_row`` (not an object; an ``id``, ``video`` or ``image`` of the wrong type),
``no_caption`` (missing, empty or not a string), ``no_media`` / ``both_media``, ``media_missing`` (no
such file), ``media_unreadable`` (not a regular file, unreadable, or PyAV / Pillow cannot open it or
decode its first frame), ``no_frames`` (a video with no video stream or 0 decodable frames),
``media_too_large`` (over ``--max-media-size``), ``image_too_large`` (an image or video frame over
``--max-image-pixels``). A video is probed with PyAV: frames (the container's count; decoded and
counted when it has none), fps (the stream's average_rate, null when unknown), width and height (of
the first decoded frame); an image with Pillow (every pixel decoded): width, height, 1 frame, fps null.

Output: one sample per written row, key ``s{row:09d}`` (its 0-based position across all inputs), two
tar members: ``clip.json`` = {"id", "caption", "media": "video" | "image", "file": "clip.<ext>",
"frames", "fps", "width", "height", "source": "<input>:<line>"} and ``clip.<ext>``, the media file's
bytes unchanged (``ext``: the file name's, lower-case; ``bin`` without one). ``line`` is the 1-based
line of a JSONL row, the 1-based position of a JSON array's row. Besides the shards RAW holds
``.nv-meta/`` (sample_type ``omniweave_clips``), ``rejects.jsonl`` (one line per rejected row:
``{"input", "line", "id", "reason", "detail"}``) and ``convert_report.json`` (``kind: "clips"``,
``input == written + rejected``, ``rejected_by_reason``). ``--strict`` makes the first bad row an
error naming it (nothing is published).

Crash safety: shards, rejects and report are written under ``RAW/.work/`` and moved into place at the
end (what a previous convert wrote into RAW is removed then, so a rerun replaces it). One process;
a rerun starts over. ``ClipRawDataset(RAW)`` reads the result (``ds[i] -> ClipSample``).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from omniweave.data.sources import shards as sh
from omniweave.errors import UserError

KIND = "clips"
CLIPS_SAMPLE_TYPE = "omniweave_clips"
META_MEMBER = "clip.json"
REJECT_REASONS = ("bad_json", "bad_row", "no_caption", "no_media", "both_media", "media_missing", "media_unreadable",
                  "no_frames", "media_too_large", "image_too_large")
MEDIA_KINDS = ("video", "image")


class NotClipsError(UserError):
    """A raw dataset that is not a ``--format clips`` conversion, given to ``ClipRawDataset``."""


class _Reject(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


# ---------------------------------------------------------------------------- flags


def _refuse_flags(args) -> None:
    """One line naming every flag given that means nothing to clip rows."""
    from omniweave.data.sources.lerobot_convert import LEROBOT_ONLY
    from omniweave.data.sources.mapping import COLUMN_FIELDS, TAG_FIELDS

    named = {f"--{k.replace('_', '-')}": getattr(args, k, None) for k in LEROBOT_ONLY}
    named.update({"--dataset-info": getattr(args, "dataset_info", None), "--dataset": getattr(args, "dataset", None),
                  "--mapping": getattr(args, "mapping", None),
                  "--auto-placeholders": getattr(args, "auto_placeholders", None)})
    named.update({f"--{k.replace('_', '-')}-key": getattr(args, f"{k}_key", None) for k in COLUMN_FIELDS})
    named.update({f"--{k.replace('_', '-')}": getattr(args, k, None) for k in TAG_FIELDS})
    given = [flag for flag, value in named.items() if value not in (None, False)]
    if given:
        raise UserError(f"--format clips reads rows of caption + video or image; {', '.join(given)} do not apply "
                        "to it (--horizon/--stride/--drop-short-episodes: --format lerobot; the others: conversations)")
    if not args.input:
        raise UserError("--format clips needs --input ROWS.jsonl [...]: JSON / JSONL rows of caption + video or image")


# ---------------------------------------------------------------------------- reading rows


@dataclass
class _Row:
    file: str  # the input as given
    line: int  # JSONL: 1-based line; JSON array: 1-based position
    raw: object  # JSONL: the line (str, or bytes if not UTF-8); JSON: the parsed element


def _read_rows(path: str) -> list[_Row]:
    data = Path(path).read_bytes()
    head = data.lstrip()[:1]
    if not path.endswith(".jsonl") and head == b"[":
        try:
            parsed = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise UserError(f"{path} is not valid JSON ({e}); one bad row in a JSON array makes the whole file "
                            "unreadable, JSONL keeps going") from e
        if not isinstance(parsed, list):
            raise UserError(f"{path}: a .json input must hold a list of rows")
        return [_Row(path, i, obj) for i, obj in enumerate(parsed, 1)]
    if not path.endswith(".jsonl") and head == b"{" and data.count(b"\n") > 1:
        try:
            single = json.loads(data)
        except (ValueError, RecursionError):
            single = None
        if isinstance(single, dict):
            raise UserError(f"{path}: a .json input must hold a list of rows (or use JSONL, one row a line)")
    rows = []
    for n, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            text: str | bytes = line.decode("utf-8")
        except UnicodeDecodeError:
            text = line
        rows.append(_Row(path, n, text))
    return rows


# ---------------------------------------------------------------------------- one row


def _media_path(ref: str, media_dir: str) -> Path:
    p = Path(ref)
    return p if p.is_absolute() else Path(media_dir) / p


def _extension(ref: str) -> str:
    ext = Path(ref).suffix[1:].lower()
    return ext if ext and ext.isascii() and ext.isalnum() else "bin"


def _read_media(path: Path, max_bytes: int) -> bytes:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise _Reject("media_missing", f"{path}: no such file") from None
    except OSError as e:
        raise _Reject("media_unreadable", f"{path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _Reject("media_unreadable", f"{path}: not a regular file")
    if st.st_size > max_bytes:
        raise _Reject("media_too_large", f"{path} holds {st.st_size} bytes, over --max-media-size {max_bytes}")
    try:
        return path.read_bytes()
    except OSError as e:
        raise _Reject("media_unreadable", f"{path}: {e.strerror or e}") from None


def probe_video(data: bytes, max_pixels: int) -> dict:
    """{frames, fps, width, height} of a video's first stream (PyAV); raises ``_Reject``."""
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except Exception as e:  # noqa: BLE001 - PyAV's failures on foreign bytes have no one type
        raise _Reject("media_unreadable", f"PyAV cannot open it ({e})") from None
    with container:
        if not container.streams.video:
            raise _Reject("no_frames", "no video stream")
        stream = container.streams.video[0]
        ctx = stream.codec_context
        if ctx.width * ctx.height > max_pixels:
            raise _Reject("image_too_large", f"a {ctx.width}x{ctx.height} frame is over --max-image-pixels {max_pixels}")
        frames = container.decode(stream)
        try:
            first = next(frames, None)
        except Exception as e:  # noqa: BLE001
            raise _Reject("media_unreadable", f"the first frame does not decode ({e})") from None
        if first is None:
            raise _Reject("no_frames", "0 decodable frames")
        count = int(stream.frames)
        if count <= 0:  # the container does not say (e.g. Matroska): decode and count
            count = 1
            try:
                for _ in frames:
                    count += 1
            except Exception as e:  # noqa: BLE001
                raise _Reject("media_unreadable", f"decoding fails after {count} frame(s) ({e})") from None
        rate = stream.average_rate
        return {"frames": count, "fps": float(rate) if rate else None, "width": int(first.width),
                "height": int(first.height)}


def probe_image(data: bytes, max_pixels: int) -> dict:
    """{frames: 1, fps: None, width, height} of an image, every pixel decoded (Pillow); raises ``_Reject``."""
    from omniweave.data.media.vision import MediaError, load_image

    try:
        with load_image(data, max_pixels) as img:
            width, height = img.size
    except MediaError as e:
        raise _Reject("image_too_large" if e.reason == "image_too_large" else "media_unreadable", e.message) from None
    return {"frames": 1, "fps": None, "width": int(width), "height": int(height)}


def convert_row(row: _Row, index: int, media_dir: str, max_bytes: int, max_pixels: int) -> tuple[dict, bytes]:
    """-> (clip.json, media bytes); raises ``_Reject`` (its ``id`` attribute set once known)."""
    obj = row.raw
    if isinstance(obj, (str, bytes)):
        try:
            obj = json.loads(obj)
        except (ValueError, RecursionError) as e:
            raise _Reject("bad_json", f"not a JSON line ({e})") from None
    if not isinstance(obj, dict):
        raise _Reject("bad_row", f"a row must be a JSON object, got {type(obj).__name__}")
    clip_id = obj.get("id")
    if clip_id is None:
        clip_id = str(index)
    elif isinstance(clip_id, int) and not isinstance(clip_id, bool):
        clip_id = str(clip_id)
    elif not isinstance(clip_id, str):
        raise _Reject("bad_row", f"'id' must be a string or an integer, got {type(clip_id).__name__}")
    try:
        caption = obj.get("caption")
        if not isinstance(caption, str) or not caption.strip():
            raise _Reject("no_caption", "no 'caption'" if caption is None else
                          f"'caption' must be a non-empty string, got {json.dumps(caption)[:80]}")
        given = [k for k in MEDIA_KINDS if obj.get(k) is not None]
        if len(given) > 1:
            raise _Reject("both_media", "a row has exactly one of 'video' and 'image', this one has both")
        if not given or obj[given[0]] == "":
            raise _Reject("no_media", "no 'video' and no 'image'")
        kind = given[0]
        ref = obj[kind]
        if not isinstance(ref, str):
            raise _Reject("bad_row", f"'{kind}' must be a path string, got {type(ref).__name__}")
        path = _media_path(ref, media_dir)
        data = _read_media(path, max_bytes)
        try:
            info = (probe_video if kind == "video" else probe_image)(data, max_pixels)
        except _Reject as e:
            raise _Reject(e.reason, f"{path}: {e.detail}") from None
    except _Reject as e:
        e.id = clip_id
        raise
    name = f"clip.{_extension(ref)}"
    meta = {"id": clip_id, "caption": caption, "media": kind, "file": name, **info, "source": f"{row.file}:{row.line}"}
    return meta, data


# ---------------------------------------------------------------------------- the command


def run(args) -> int:
    from tqdm import tqdm

    from omniweave.data.media.vision import IMAGE_PIXELS_CEILING

    t0 = time.perf_counter()
    _refuse_flags(args)
    if not 0 < args.max_image_pixels <= IMAGE_PIXELS_CEILING or args.max_media_size <= 0:
        raise UserError(f"--max-image-pixels must be in 1..{IMAGE_PIXELS_CEILING} and --max-media-size positive")
    files = list(args.input)
    for f in files:
        if not Path(f).is_file():
            raise UserError(f"input {f} not found" + (" (--format clips reads JSON / JSONL files)"
                                                      if Path(f).is_dir() else ""))
    rows = [(r, args.media_dir or str(Path(f).parent)) for f in files for r in _read_rows(f)]

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    work = out / ".work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    records, rejects, writer = [], [], None
    media_items: Counter = Counter({"video": 0, "image": 0})
    media_bytes = frames = 0

    def close_writer():
        nonlocal writer
        if writer is not None:
            records.append(sh.finalize_shard(writer, work / f"part-{len(records):06d}.tar"))
        writer = None

    bar = tqdm(total=len(rows), unit="row", desc="convert clips", disable=args.no_progress or None,
               dynamic_ncols=True)
    try:
        for g, (row, media_dir) in enumerate(rows):
            try:
                meta, data = convert_row(row, g, media_dir, args.max_media_size, args.max_image_pixels)
            except _Reject as e:
                rec = {"input": row.file, "line": row.line, "id": getattr(e, "id", None), "reason": e.reason,
                       "detail": e.detail}
                if args.strict:
                    named = f" (id {rec['id']!r})" if rec["id"] is not None else ""
                    raise UserError(f"{row.file}:{row.line}: row{named} is bad: "
                                    f"{e.reason} ({e.detail}); --strict stops at the first bad row, without it "
                                    "the row is counted in rejects.jsonl") from None
                rejects.append(rec)
            else:
                if writer is not None and (writer.count >= args.maxcount or writer.size >= args.maxsize):
                    close_writer()
                if writer is None:
                    writer = sh.ShardWriter(work / f"part-{len(records):06d}.tar.tmp")
                writer.write(sh.sample_key(g), {META_MEMBER: json.dumps(meta, ensure_ascii=False).encode("utf-8"),
                                                meta["file"]: data})
                media_items[meta["media"]] += 1
                media_bytes += len(data)
                frames += meta["frames"]
            bar.update()
        close_writer()
    except BaseException:
        bar.close()
        if writer is not None:
            writer.abort()
        shutil.rmtree(work, ignore_errors=True)
        raise
    bar.close()
    return _publish(args, out, work, files, len(rows), records, rejects, media_items, media_bytes, frames, t0)


def _publish(args, out: Path, work: Path, files: list[str], n_rows: int, records: list, rejects: list,
             media_items: Counter, media_bytes: int, frames: int, t0: float) -> int:
    """Replace what a previous convert left in RAW with the finished output in .work."""
    from omniweave.data.sources.convert import _clear_output
    from omniweave.data.sources.lerobot_convert import _clear_previous

    written = sum(r["count"] for r in records)
    assert n_rows == written + len(rejects), "row accounting is broken"
    by_reason = dict(sorted(Counter(r["reason"] for r in rejects).items()))
    with open(work / "rejects.jsonl", "w") as f:
        for r in rejects:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    total_bytes = sum(r["bytes"] for r in records)
    seconds = time.perf_counter() - t0
    report = {
        "kind": KIND, "format": "clips", "inputs": files, "media_dir": args.media_dir,
        "input": n_rows, "written": written, "rejected": len(rejects), "rejected_by_reason": by_reason,
        "media_items": dict(media_items), "media_bytes": media_bytes, "frames": frames, "bytes": total_bytes,
        "seconds": round(seconds, 3), "maxcount": args.maxcount, "maxsize": args.maxsize,
        "shards": [{"name": sh.shard_name(i), "count": r["count"], "bytes": r["bytes"]} for i, r in enumerate(records)],
    }
    (work / "convert_report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")

    _clear_previous(out)  # a LeRobot conversion's videos/ and stats
    _clear_output(out, keep_work=True)  # shards, .nv-meta, rejects, report
    shard_records = sh.publish_shards(work, out, records, CLIPS_SAMPLE_TYPE)
    os.replace(work / "rejects.jsonl", out / "rejects.jsonl")
    os.replace(work / "convert_report.json", out / "convert_report.json")  # last: the report says it is complete
    shutil.rmtree(work, ignore_errors=True)

    reasons = ", ".join(f"{k}: {v}" for k, v in by_reason.items())
    print(f"convert: {n_rows} rows -> {written} clips ({media_items['video']} video(s), {media_items['image']} "
          f"image(s), {frames} frames) in {len(shard_records)} shard(s) ({total_bytes / 1e6:.1f} MB), "
          f"{len(rejects)} rejected{f' ({reasons})' if reasons else ''} in {seconds:.1f}s -> {out}"
          + (f"; see {out / 'rejects.jsonl'}" if rejects else ""))
    if n_rows and not written:
        print(f"omniweave data convert: error: every row was rejected ({reasons}); each row and its reason is in "
              f"{out / 'rejects.jsonl'}", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------- reading the result


@dataclass(frozen=True)
class ClipSample:
    key: str  # the sample key, ``s{row:09d}``
    meta: dict  # clip.json: id, caption, media, file, frames, fps, width, height, source
    data: bytes  # the media file's bytes, as converted (not decoded)


_HOLDS = {sh.SAMPLE_TYPE: "conversations", "conversation": "conversations",
          sh.VLA_SAMPLE_TYPE: "robot frames (a LeRobot conversion)", "vla": "robot frames (a LeRobot conversion)"}


def raw_kind(root: str | Path) -> str | None:
    """The sample_type of ``.nv-meta/dataset.yaml``, else convert_report.json's ``kind``, else None."""
    root = Path(root)
    meta = root / sh.META_DIR / "dataset.yaml"
    if meta.is_file():
        for line in meta.read_text(errors="replace").splitlines():
            key, _, value = line.strip().partition(":")
            if key == "sample_type" and value.strip():
                return value.strip()
    report = root / "convert_report.json"
    if report.is_file():
        try:
            return json.loads(report.read_text()).get("kind")
        except ValueError:
            return None
    return None


def check_clips_raw(root: str | Path) -> None:
    """``NotClipsError`` unless RAW is a ``--format clips`` conversion (or says nothing of its kind)."""
    kind = raw_kind(root)
    if kind not in (None, CLIPS_SAMPLE_TYPE, KIND):
        raise NotClipsError(f"{root}: RAW holds {_HOLDS.get(kind, f'{kind} samples')}; convert clips with "
                            "--format clips (omniweave data convert --format clips --input ROWS.jsonl --output RAW)")


class ClipRawDataset(sh.RawDataset):
    """Random access over a clips conversion: ``len(ds)``, ``ds[i] -> ClipSample`` (one seek via
    ``.tar.idx``; media bytes as stored, nothing decoded), iteration in order, ``ds.shards``."""

    def __init__(self, root: str | Path):
        check_clips_raw(root)
        super().__init__(root)

    def _sample(self, chunk: bytes) -> ClipSample:
        key, parts = sh.parse_sample_bytes(chunk)
        if META_MEMBER not in parts:
            raise NotClipsError(f"{self.root}: sample {key} has no {META_MEMBER} (members {sorted(parts)}): not a "
                                "clips conversion; convert clips with --format clips")
        meta = json.loads(parts[META_MEMBER].decode("utf-8"))
        return ClipSample(key=key, meta=meta, data=parts[meta["file"]])

    def __getitem__(self, i: int) -> ClipSample:
        return self._sample(self.read_bytes(i))

    def __iter__(self) -> Iterator[ClipSample]:
        for shard, info in enumerate(self.shards):
            offs = self._offsets[shard]
            with open(self.root / info.name, "rb") as f:
                for j in range(info.count):
                    f.seek(int(offs[j]))
                    yield self._sample(f.read(int(offs[j + 1]) - int(offs[j])))
