"""Raw shards: WebDataset tars with Energon's index files, written atomically, read in O(1).

Layout of a raw dataset directory RAW::

    RAW/shard-000000.tar        WebDataset samples, key ``s{global_index:09d}``; parts
                                ``json`` (Conversation.to_json(), images/videos/audios = part names),
                                ``img{i}.{ext}`` / ``vid{i}.{ext}`` (original file bytes); VLA shards
                                (``--format lerobot``, lerobot_convert.py): one part ``vla.json``
    RAW/shard-000000.tar.idx    little-endian uint64 byte offset of each sample's first tar
                                header, plus the end offset of the last sample (Energon format)
    RAW/.nv-meta/dataset.yaml   Energon crude dataset, subflavor sample_type=omniweave_conversation
                                (omniweave_vla for VLA shards)
    RAW/.nv-meta/split.yaml     every shard in the ``train`` split
    RAW/.nv-meta/.info.json     per-shard sample counts (Energon ``WebdatasetInfo``)
    RAW/.nv-meta/index.sqlite   Energon's random-access index (samples, sample_parts)

A shard is written under a temporary name and renamed into place only when complete (its
``.tar.idx`` first, then the ``.tar``), so a ``shard-*.tar`` that exists is always whole.
"""

from __future__ import annotations

import bisect
import io
import json
import os
import sqlite3
import struct
import tarfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from omniweave.data.sample import Conversation, RawSample

if TYPE_CHECKING:
    import numpy as np

META_DIR = ".nv-meta"
SAMPLE_TYPE = "omniweave_conversation"
VLA_SAMPLE_TYPE = "omniweave_vla"  # per-frame robot samples (data/sources/lerobot_convert.py)
BLOCK, RECORD = tarfile.BLOCKSIZE, tarfile.RECORDSIZE  # 512, 10240
ENERGON_VERSION = "7.4.1"  # the version whose on-disk format these files follow


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.tar"


def sample_key(global_index: int) -> str:
    return f"s{global_index:09d}"


@dataclass(frozen=True)
class ShardInfo:
    name: str  # file name relative to the dataset root, e.g. "shard-000000.tar"
    count: int  # samples in the shard
    bytes: int  # size of the tar file


# ---------------------------------------------------------------------------- writing


class ShardWriter:
    """Writes one tar shard to ``tmp_path``; ``close()`` returns the end offset of the last sample.

    USTAR members with fixed metadata (mtime 0, uid/gid 0, mode 0o644), so the same input gives
    byte-identical shards; headers come from ``tarfile`` and data is written in one call per
    part (no chunked copy).
    """

    def __init__(self, tmp_path: str | Path):
        self.tmp_path = Path(tmp_path)
        self._file = open(self.tmp_path, "wb")
        self._offset = 0
        self.offsets: list[int] = []  # offset of each sample's first header
        self.keys: list[str] = []
        self.parts: list[list[tuple[str, int, int]]] = []  # per sample: (part, data offset, size)

    @property
    def count(self) -> int:
        return len(self.offsets)

    @property
    def size(self) -> int:
        return self._offset

    def write(self, key: str, parts: dict[str, bytes]) -> None:
        """One sample: ``parts`` maps part name (``json``, ``img0.png``…) to bytes, in order."""
        if "." in key or "/" in key:
            raise ValueError(f"sample key {key!r} must not contain '.' or '/'")
        self.offsets.append(self._offset)
        self.keys.append(key)
        sample_parts = []
        for part, data in parts.items():
            info = tarfile.TarInfo(f"{key}.{part}")
            info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
            info.uname = info.gname = ""
            header = info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
            pad = -len(data) % BLOCK
            self._file.write(header)
            self._file.write(data)
            if pad:
                self._file.write(b"\0" * pad)
            sample_parts.append((part, self._offset + len(header), len(data)))
            self._offset += len(header) + len(data) + pad
        self.parts.append(sample_parts)

    def close(self) -> int:
        """End-of-archive blocks, padded to tar's 10 KiB record as ``tarfile`` does; fsync."""
        end = self._offset
        trailer = 2 * BLOCK
        trailer += -(end + trailer) % RECORD
        self._file.write(b"\0" * trailer)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return end

    def abort(self) -> None:
        self._file.close()
        self.tmp_path.unlink(missing_ok=True)


def write_conversation_sample(writer: ShardWriter, key: str, conv: Conversation, media: dict[str, bytes]) -> None:
    """``conv.images``/``conv.videos``/``conv.audios`` must already name parts present in ``media``."""
    parts = {"json": json.dumps(conv.to_json(), ensure_ascii=False).encode("utf-8")}
    for name in [*conv.images, *conv.videos, *conv.audios]:
        parts[name] = media[name]
    writer.write(key, parts)


def finalize_shard(writer: ShardWriter, final_path: str | Path) -> dict:
    """Close ``writer`` and move its tar (and a fresh ``.tar.idx``) to ``final_path`` atomically.

    Returns a record ``{name, count, bytes, keys, parts, offsets}`` used to build the indices.
    """
    final_path = Path(final_path)
    end = writer.close()
    offsets = [*writer.offsets, end]
    idx_tmp = writer.tmp_path.with_name(writer.tmp_path.name + ".idx")
    idx_tmp.write_bytes(struct.pack(f"<{len(offsets)}Q", *offsets))
    os.replace(idx_tmp, final_path.with_name(final_path.name + ".idx"))
    os.replace(writer.tmp_path, final_path)  # last: a shard-*.tar that exists is complete
    return {
        "name": final_path.name,
        "count": writer.count,
        "bytes": final_path.stat().st_size,
        "keys": list(writer.keys),
        "offsets": [int(o) for o in offsets],
        "parts": writer.parts,
    }


def publish_shards(work: Path, out: Path, records: list[dict], sample_type: str) -> list[dict]:
    """Move a converter's finished shards from ``work`` into ``out`` under their final names (each
    ``.idx`` before its tar) and write ``.nv-meta``; returns the records with the final names."""
    published = []
    for rec in records:
        name = shard_name(len(published))
        src, dst = Path(work) / rec["name"], Path(out) / name
        os.replace(src.with_name(src.name + ".idx"), dst.with_name(name + ".idx"))
        os.replace(src, dst)
        published.append({**rec, "name": name})
    write_metadata(out, published, sample_type=sample_type)
    return published


def write_metadata(root: str | Path, shards: list[dict], sample_type: str = SAMPLE_TYPE) -> None:
    """Energon metadata for ``shards`` (records from ``finalize_shard``, in dataset order)."""
    meta = Path(root) / META_DIR
    meta.mkdir(parents=True, exist_ok=True)
    names = [s["name"] for s in shards]
    _atomic_text(
        meta / "dataset.yaml",
        "__module__: megatron.energon\n__class__: CrudeWebdataset\nsubflavors:\n"
        f"  sample_type: {sample_type}\n",
    )
    _atomic_text(meta / "split.yaml", "split_parts:\n  train:\n" + "".join(f"  - {n}\n" for n in names) + "exclude: []\n")
    info = {"energon_version": ENERGON_VERSION, "shard_counts": {s["name"]: s["count"] for s in shards}}
    _atomic_text(meta / ".info.json", json.dumps(info, indent=2) + "\n")
    _write_sqlite_index(meta / "index.sqlite", shards)
    _atomic_text(meta / "index.uuid", str(uuid.uuid4()))


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_sqlite_index(path: Path, shards: list[dict]) -> None:
    """The ``index.sqlite`` Energon's ``energon prepare`` builds (tables samples, sample_parts)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    db = sqlite3.connect(tmp)
    db.execute(
        "CREATE TABLE samples (tar_file_id INTEGER NOT NULL, sample_key TEXT NOT NULL UNIQUE,"
        " sample_index INTEGER NOT NULL, byte_offset INTEGER, byte_size INTEGER)"
    )
    db.execute(
        "CREATE TABLE sample_parts (tar_file_id INTEGER, sample_index INTEGER, part_name TEXT,"
        " content_byte_offset INTEGER, content_byte_size INTEGER)"
    )
    for tar_id, s in enumerate(shards):
        offs = s["offsets"]
        db.executemany(
            "INSERT INTO samples VALUES (?, ?, ?, ?, ?)",
            ((tar_id, k, i, offs[i], offs[i + 1] - offs[i]) for i, k in enumerate(s["keys"])),
        )
        db.executemany(
            "INSERT INTO sample_parts VALUES (?, ?, ?, ?, ?)",
            ((tar_id, i, p, o, n) for i, parts in enumerate(s["parts"]) for p, o, n in parts),
        )
    db.execute("CREATE INDEX idx_samples_by_tar_and_idx ON samples(tar_file_id, sample_index)")
    db.execute("CREATE INDEX idx_sample_parts_seq ON sample_parts(tar_file_id, sample_index, content_byte_offset)")
    db.execute(
        "CREATE INDEX idx_sample_parts_full ON sample_parts"
        "(tar_file_id, sample_index, part_name, content_byte_offset, content_byte_size)"
    )
    db.commit()
    db.close()
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- reading


def read_tar_index(path: str | Path) -> "np.ndarray":
    """uint64 offsets from a ``.tar.idx`` (one per sample plus the end offset)."""
    import numpy as np

    return np.frombuffer(Path(path).read_bytes(), dtype="<u8")


def parse_sample_bytes(chunk: bytes) -> tuple[str, dict[str, bytes]]:
    """The tar members of one sample (``chunk`` = bytes between two index offsets)."""
    key, parts = None, {}
    with tarfile.open(fileobj=io.BytesIO(chunk), mode="r:") as tar:
        for member in tar:
            if not member.isreg():
                continue
            base, _, part = member.name.partition(".")
            if key is None:
                key = base
            elif base != key:
                raise ValueError(f"sample chunk holds two keys: {key!r} and {base!r}")
            parts[part] = tar.extractfile(member).read()
    if key is None:
        raise ValueError("empty sample chunk")
    return key, parts


def raw_sample_from_parts(key: str, parts: dict[str, bytes]) -> RawSample:
    conv = Conversation.from_json(json.loads(parts["json"].decode("utf-8")))
    media = {name: parts[name] for name in [*conv.images, *conv.videos, *conv.audios]}
    return RawSample(key=key, conversation=conv, media=media)


class RawDataset:
    """Random access over a raw shard directory: ``len(ds)``, ``ds[i]`` (one seek via
    ``.tar.idx``), iteration in order, ``ds.shards``."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        info_file = self.root / META_DIR / ".info.json"
        if info_file.is_file():
            counts = json.loads(info_file.read_text())["shard_counts"]
            names = list(counts)
        else:  # shards without metadata (e.g. copied by hand): trust the .tar.idx files
            names = sorted(p.name for p in self.root.glob("shard-*.tar"))
            counts = None
        if not names:
            raise FileNotFoundError(f"{self.root}: no raw shards (expected shard-NNNNNN.tar and {META_DIR}/.info.json)")
        self._offsets: list["np.ndarray"] = []
        shards = []
        for name in names:
            path = self.root / name
            if not path.is_file():
                raise FileNotFoundError(f"{path}: listed in {META_DIR}/.info.json but missing")
            offs = read_tar_index(path.with_name(name + ".idx"))
            count = len(offs) - 1
            if counts is not None and counts[name] != count:
                raise ValueError(f"{path}: .info.json says {counts[name]} samples, .tar.idx has {count}")
            self._offsets.append(offs)
            shards.append(ShardInfo(name=name, count=count, bytes=path.stat().st_size))
        self.shards = shards
        self._starts = [0]
        for s in shards:
            self._starts.append(self._starts[-1] + s.count)

    def __len__(self) -> int:
        return self._starts[-1]

    def locate(self, i: int) -> tuple[int, int]:
        """Global sample index -> (shard number, index within the shard)."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        i %= len(self)
        shard = bisect.bisect_right(self._starts, i) - 1
        return shard, i - self._starts[shard]

    def read_bytes(self, i: int) -> bytes:
        shard, j = self.locate(i)
        offs = self._offsets[shard]
        start, end = int(offs[j]), int(offs[j + 1])
        with open(self.root / self.shards[shard].name, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    def __getitem__(self, i: int) -> RawSample:
        return raw_sample_from_parts(*parse_sample_bytes(self.read_bytes(i)))

    def __iter__(self) -> Iterator[RawSample]:
        for shard, info in enumerate(self.shards):
            offs = self._offsets[shard]
            with open(self.root / info.name, "rb") as f:
                for j in range(info.count):
                    f.seek(int(offs[j]))
                    chunk = f.read(int(offs[j + 1]) - int(offs[j]))
                    yield raw_sample_from_parts(*parse_sample_bytes(chunk))
