"""Packed dataset on disk: writer and O(1) random-access reader. No pickle anywhere.

    PACKED/manifest.json                 fingerprint, data cfg, algorithm, source + packed shards
    PACKED/stats.json  lengths.png       efficiency and counts (see pack.py)
    PACKED/packs-NNNNNN.bin              flat little-endian records, one per pack:
                                           input_ids int32 [L] | labels int32 [L] (SHIFTED) |
                                           position_ids int32 [R, L] | media bytes …
    PACKED/packs-NNNNNN.json             index of the shard (written last = the shard is done):
                                           {"packs": [record, …]} with, per pack, its byte offset,
                                           L, R, cu_seqlens, docs and media descriptors
                                           (every item: kind, part, doc, sample, start, length,
                                           offset, size, [pieces]; images / videos: grid_thw,
                                           resized_hw, frame_indices, second_per_grid; audio:
                                           num_samples at 16 kHz, one piece per encoder item;
                                           ``same_as``: the index of an earlier descriptor of
                                           the pack whose bytes and features this one reuses,
                                           no bytes of its own: a preference pair's 2nd side)
                                         and per document its arrays (a VLA frame's action chunk:
                                           ``arrays: {name: {offset, dtype, shape}}``, raw bytes)

Labels are stored shifted: ``labels[i]`` is the target of position i, -100 on the last token of
every document (it predicts nothing) and wherever the unshifted label was -100.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

import numpy as np

from omniweave.data.sample import TokenizedSample
from omniweave.data.text.template import IGNORE_INDEX
from omniweave.errors import UserError

FORMAT = "omniweave-packed/1"
MANIFEST = "manifest.json"


def pack_shard_name(index: int) -> str:
    return f"packs-{index:06d}"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=1) + "\n").encode())


def shift_labels(labels: np.ndarray) -> np.ndarray:
    """Unshifted labels of ONE document -> shifted: out[i] = labels[i + 1], out[-1] = -100."""
    out = np.full_like(labels, IGNORE_INDEX)
    out[:-1] = labels[1:]
    return out


def shifted_weights(sample: TokenizedSample) -> dict:
    """A document's fractional loss weights for its pack record: ``{"loss_weights": [[start, end, w],
    …]}`` over its *shifted* labels (label i predicts token i + 1, so a token's run moves back by
    one), or {} when every loss token weighs 1 (then the record is as it always was)."""
    if not sample.loss_weights:
        return {}
    return {"loss_weights": [[max(start - 1, 0), end - 1, w] for start, end, w in sample.loss_weights if end > 1]}


def pack_arrays(samples: list[TokenizedSample]) -> dict:
    """Concatenate tokenized documents into one pack row (numpy, int32)."""
    input_ids = np.concatenate([s.input_ids for s in samples]).astype(np.int32)
    labels = np.concatenate([shift_labels(s.labels) for s in samples]).astype(np.int32)
    position_ids = np.concatenate([s.position_ids for s in samples], axis=1).astype(np.int32)
    cu_seqlens = np.concatenate([[0], np.cumsum([len(s) for s in samples])]).astype(np.int32)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "cu_seqlens": cu_seqlens}


def _kind_fields(span) -> dict:
    """The descriptor fields of one kind of media: the patch grid of an image / video, the length of a clip."""
    if span.kind == "audio":
        return {"num_samples": span.num_samples}
    return {"resized_hw": list(span.resized_hw), "grid_thw": list(span.grid_thw),
            "frame_indices": span.frame_indices, "second_per_grid": span.second_per_grid}


def media_descriptor(span, doc: int, sample: int, doc_start: int) -> dict:
    """A media item's descriptor in a pack whose document ``doc`` starts at ``doc_start``: kind,
    part, where its placeholder tokens sit in the row, its grid (bytes located by the caller)."""
    return {"kind": span.kind, "part": span.part, "doc": doc, "sample": sample, **_kind_fields(span),
            "start": doc_start + span.start, "length": span.length,
            **({"pieces": [[doc_start + a, n] for a, n in span.pieces]} if span.pieces else {})}


def _shared_media(docs: list, of_doc: list[list[int]], d: int, same_as: int | None) -> list[int] | None:
    """Descriptor indices of the earlier document whose media doc ``d`` reuses (``same_media_as``:
    a relative doc offset, e.g. -1 for a preference pair's rejected side), or None. The two docs'
    media must be the same items in the same order (a pair's prompt is the same)."""
    if same_as is None:
        return None
    src = d + int(same_as)
    mine, theirs = docs[d][0].media, docs[src][0].media if 0 <= src < d else None
    if theirs is None or [(m.kind, m.part, m.length) for m in mine] != [(m.kind, m.part, m.length) for m in theirs]:
        raise ValueError(f"document {d} shares the media of document {src}, but their media items differ")
    return of_doc[src]


class PackedShardWriter:
    """Appends packs to ``packs-NNNNNN.bin.tmp``; ``close()`` publishes .bin then .json atomically."""

    def __init__(self, root: str | Path, index: int):
        self.base = Path(root) / pack_shard_name(index)
        self.bin_path = self.base.with_suffix(".bin")
        self.tmp = self.base.with_suffix(".bin.tmp")
        self._file = open(self.tmp, "wb")
        self.records: list[dict] = []

    def add(self, docs: list[tuple[TokenizedSample, dict[str, bytes], dict]]) -> dict:
        """docs: (tokenized sample, its media bytes by part, doc info {index, key}) in pack order."""
        arrays = pack_arrays([d[0] for d in docs])
        L, R = len(arrays["input_ids"]), arrays["position_ids"].shape[0]
        offset = self._file.tell()
        for name in ("input_ids", "labels", "position_ids"):
            self._file.write(np.ascontiguousarray(arrays[name], dtype="<i4").tobytes())
        media, of_doc = [], []  # descriptors; each doc's descriptor indices
        for d, ((sample, media_bytes, info), doc_start) in enumerate(zip(docs, arrays["cu_seqlens"][:-1].tolist())):
            shared = _shared_media(docs, of_doc, d, info.get("same_media_as"))
            of_doc.append([])
            for k, span in enumerate(sample.media):
                data = b"" if shared else media_bytes[span.part]
                of_doc[-1].append(len(media))
                media.append({**media_descriptor(span, d, info["index"], doc_start),
                              "offset": self._file.tell(), "size": len(data),
                              **({"same_as": shared[k]} if shared else {})})
                self._file.write(data)
        doc_arrays = [self._write_arrays(info.get("arrays")) for _, _, info in docs]
        record = {
            "offset": offset, "length": L, "rows": R,
            "cu_seqlens": arrays["cu_seqlens"].tolist(),
            "docs": [{"id": s.id, **{k: v for k, v in info.items() if k != "arrays"}, "length": len(s),
                      "truncated": bool(s.truncated), **shifted_weights(s), **({"arrays": a} if a else {})}
                     for (s, _, info), a in zip(docs, doc_arrays)],
            "media": media,
            "num_loss_tokens": int((arrays["labels"] != IGNORE_INDEX).sum()),
        }
        self.records.append(record)
        return record

    def _write_arrays(self, arrays: dict | None) -> dict:
        """A document's named arrays as raw little-endian bytes; their descriptors."""
        out = {}
        for name, value in (arrays or {}).items():
            value = np.ascontiguousarray(value)
            dtype = value.dtype.newbyteorder("<")
            out[name] = {"offset": self._file.tell(), "dtype": dtype.str, "shape": list(value.shape)}
            self._file.write(value.astype(dtype).tobytes())
        return out

    def close(self) -> dict:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.tmp, self.bin_path)
        size = self.bin_path.stat().st_size
        atomic_write_json(self.base.with_suffix(".json"), {"format": FORMAT, "bytes": size, "packs": self.records})
        return {"name": self.base.name, "packs": len(self.records), "bytes": size}


@lru_cache(maxsize=64)
def _shard_index(path: str) -> list[dict]:
    return json.loads(Path(path).read_text())["packs"]


class PackedDataset:
    """``len(ds)`` packs; ``ds[i]`` -> dict of numpy arrays + media descriptors with their bytes.

    Pack i is found in O(1): the manifest gives each shard's first pack id; a shard's JSON index
    is read once (cached) and each record holds the byte offset of its pack."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        path = self.root / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"{path} missing: not a packed dataset, or `omniweave data pack` has not finished")
        self.manifest = json.loads(path.read_text())
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{path}: format {self.manifest.get('format')!r}, expected {FORMAT!r}")
        self.shards = self.manifest["packed_shards"]
        self._check_shard_files()
        counts = [s["packs"] for s in self.shards]
        self._shard_of = np.repeat(np.arange(len(counts)), counts)
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def _check_shard_files(self) -> None:
        """Every shard the manifest lists is there, whole: its ``.bin`` of the size it was written
        with and its index (a copy cut short or a lost file is named now, not at the step that reads it)."""
        for shard in self.shards:
            data, index = self.root / f"{shard['name']}.bin", self.root / f"{shard['name']}.json"
            if not data.is_file() or not index.is_file():
                raise PackedDamaged(f"packed dataset {self.root}: {data.name if not data.is_file() else index.name} "
                                    "is missing; repack, or copy the dataset again")
            size = data.stat().st_size
            if "bytes" in shard and size != shard["bytes"]:
                raise PackedDamaged(f"packed dataset {self.root}: {data.name} has {size} bytes, {shard['bytes']} when "
                                    "it was written (cut short or changed); repack, or copy the dataset again")

    def __len__(self) -> int:
        return int(self._first[-1])

    def record(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(f"pack {i} out of range for {len(self)} packs")
        shard = int(self._shard_of[i])
        name = self.shards[shard]["name"]
        return _shard_index(str(self.root / f"{name}.json"))[i - int(self._first[shard])] | {"shard": name}

    def __getitem__(self, i: int) -> dict:
        rec = self.record(i)
        L, R = rec["length"], rec["rows"]
        with open(self.root / f"{rec['shard']}.bin", "rb") as f:
            f.seek(rec["offset"])
            flat = np.frombuffer(f.read(4 * L * (2 + R)), dtype="<i4")
            media = []
            for m in rec["media"]:
                f.seek(m["offset"])
                media.append({**m, "bytes": f.read(m["size"])})
            doc_arrays = [self._read_arrays(f, i, rec, doc.get("arrays", {})) for doc in rec["docs"]]
        self._check_pack(i, rec, flat, media)
        return {
            "input_ids": flat[:L], "labels": flat[L : 2 * L], "position_ids": flat[2 * L :].reshape(R, L),
            "cu_seqlens": np.asarray(rec["cu_seqlens"], np.int32), "media": media, "docs": rec["docs"],
            "doc_arrays": doc_arrays,
            "num_loss_tokens": rec["num_loss_tokens"], "index": i, "shard": rec["shard"],
        }


    def _read_arrays(self, f, i: int, rec: dict, arrays: dict) -> dict[str, np.ndarray]:
        out = {}
        for name, d in arrays.items():
            dtype = np.dtype(d["dtype"])
            size = dtype.itemsize * int(np.prod(d["shape"]))
            f.seek(d["offset"])
            data = f.read(size)
            if len(data) != size:
                raise PackedDamaged(f"packed dataset {self.root}: pack {i} ({rec['shard']}.bin) is cut short in its "
                                    f"{name} array: the dataset is damaged; repack it")
            out[name] = np.frombuffer(data, dtype=dtype).reshape(d["shape"])
        return out

    def _check_pack(self, i: int, rec: dict, flat: np.ndarray, media: list[dict]) -> None:
        """What a damaged pack cannot pass (cheap, every read): its bytes all there, token ids not
        negative, labels a token id or -100, documents covering exactly its tokens."""
        L, R = rec["length"], rec["rows"]
        where = f"packed dataset {self.root}: pack {i} ({rec['shard']}.bin at byte {rec['offset']})"
        problem = None
        if len(flat) != L * (2 + R) or any(len(m["bytes"]) != m["size"] for m in media):
            problem = "is cut short"
        elif L and int(flat[:L].min()) < 0:
            problem = f"has a negative token id ({int(flat[:L].min())})"
        elif L and ((flat[L:2 * L] < 0) & (flat[L:2 * L] != IGNORE_INDEX)).any():
            problem = "has a label that is neither a token id nor -100"
        elif not rec["cu_seqlens"] or rec["cu_seqlens"][0] != 0 or rec["cu_seqlens"][-1] != L:
            problem = f"has documents spanning {rec['cu_seqlens'][-1:] or '?'} of its {L} tokens"
        if problem:
            raise PackedDamaged(f"{where} {problem}: the dataset is damaged; repack it")


class PackedDamaged(UserError):
    """A packed dataset whose files do not hold what its manifest and indexes say."""


def fingerprint_diff(built: dict, wanted: dict, prefix: str = "data") -> list[str]:
    """Dotted names of the fields where two fingerprints differ, with both values."""
    diffs = []
    for key in sorted(set(built) | set(wanted)):
        a, b = built.get(key), wanted.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += fingerprint_diff(a, b, f"{prefix}.{key}")
        elif a != b:
            # a key on one side only: another kind of recipe (I2V vs T2V packs) or an older omniweave
            was = "without it" if key not in built else f"with {a!r}"
            now = "without it" if key not in wanted else repr(b)
            diffs.append(f"{prefix}.{key}: packed {was}, now {now}")
    return diffs


class PackMismatch(UserError, ValueError):
    """The packs were built with other data settings than the recipe's."""


def check_fingerprint(manifest: dict, data_cfg, where: str = "") -> None:
    """Raise ValueError naming every field where ``data_cfg`` disagrees with what built the packs."""
    from omniweave.data.text.tokenize import SampleProcessor

    wanted = SampleProcessor(data_cfg).fingerprint()
    diffs = fingerprint_diff(manifest["fingerprint"], wanted)
    if diffs:
        raise PackMismatch(f"packed dataset {where} was built with different data settings; repack it or fix the "
                           "recipe: " + "; ".join(diffs))
