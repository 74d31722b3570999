"""Reading a checkpoint without trusting it: no code runs, and damaged bytes are found.

A checkpoint may come from a stranger (``train.init_from``, ``--resume``, ``hf export`` of a
downloaded run), so nothing in it may run code on the reader:

- DCP reads its ``.metadata`` with ``pickle.load`` and the non-tensor values of a state dict
  (the optimizer's hyperparameters) with ``torch.load(weights_only=False)``; a crafted pickle runs
  a shell command there. :func:`read_metadata` unpickles ``.metadata`` admitting only the
  checkpoint-metadata classes DCP writes (:data:`ALLOWED`), and :func:`dcp_load` reads every
  value with ``torch.load(weights_only=True)`` (tensors, numbers, strings, containers). A refused
  file is one :class:`CheckpointRefused` line naming it and the global it asked for.
- Each save records ``checksums.json`` (SHA-256 and size of every file, hashed by the ranks
  in turn); :func:`verify` checks them before anything is loaded, so a flipped bit, a truncated
  shard or an edited ``trainer_state.json`` is named instead of loaded (:class:`CheckpointDamaged`).
  Checkpoints saved before checksums existed load with one warning.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from omniweave.errors import UserError, first_few

CHECKSUMS = "checksums.json"
_PART = ".checksums-rank{}.json"  # one rank's hashes while a save is being published

# (module, name) pairs DCP's .metadata may name: the metadata dataclasses, torch.Size, the dtypes
# (checked below), and the path DCP records as the checkpoint id
ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class CheckpointRefused(UserError):
    """A checkpoint file asked for something a checkpoint never holds (code to run)."""


class CheckpointDamaged(UserError):
    """A checkpoint file does not match the checksum recorded when it was saved."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointRefused(
            f"{self.path}: refused to read it — it asks for {module}.{name}, which no checkpoint holds "
            "(only DCP's metadata classes are admitted: this file may have been made to run code)")


def read_metadata(path: str | os.PathLike):
    """DCP's ``Metadata`` of checkpoint ``path``, unpickled with only :data:`ALLOWED` classes."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f, file).load()
    except CheckpointRefused:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise CheckpointDamaged(f"{file}: not a checkpoint's metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointRefused(f"{file}: holds a {type(metadata).__name__}, not a checkpoint's metadata")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def _safe_reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            if kwargs.get("rank") is not None:  # per-rank metadata files: a layout we never write
                raise CheckpointRefused(f"{path}: per-rank metadata files are not supported")
            metadata = read_metadata(path)
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def _safe_planner():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        """DCP's planner, with non-tensor values read as ``weights_only`` (DCP uses full pickle)."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                asks = re.search(r"GLOBAL ([\w.]+)", str(e))  # the wording differs between torch versions
                raise CheckpointRefused(
                    f"refused to read {read_item.dest_index.fqn} of a checkpoint — it asks for "
                    f"{asks[1] if asks else 'something other than plain data'}, which no checkpoint holds "
                    "(this file may have been made to run code)") from None
            super().load_bytes(read_item, _as_bytes(obj))

    return SafePlanner()


def _as_bytes(obj) -> io.BytesIO:
    """``obj`` re-serialised, for the parent planner to read back (now known to be plain data)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def dcp_load(state: dict, path: str | os.PathLike) -> None:
    """``dcp.load(state, checkpoint_id=path)`` reading only plain data (see the module doc)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=_safe_reader(Path(path)), planner=_safe_planner())
    except CheckpointException as e:  # DCP gathers each rank's exception: a refusal stays one line
        for exc in gathered_failures(e):
            if isinstance(exc, UserError):
                raise exc from None
        raise


def gathered_failures(error: BaseException) -> list[BaseException]:
    """Each rank's own exception inside DCP's ``CheckpointException`` (its ``failures`` map rank ->
    exception, or (exception, traceback)); ``[error]`` for any other exception."""
    failures = getattr(error, "failures", None)
    if not failures:
        return [error]
    return [f[0] if isinstance(f, tuple) else f for f in failures.values()]


# ---------------------------------------------------------------------------------------- checksums

def _sha256(file: Path) -> str:
    with open(file, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _share(files: list[Path]) -> list[Path]:
    """This rank's turn of ``files`` (sorted), so that the ranks hash a checkpoint between them."""
    rank, world = _rank_world()
    return sorted(files)[rank::world]


def hash_share(tmp: Path) -> None:
    """Each rank: hash its turn of the files a save wrote so far into ``tmp/.checksums-rankR.json``
    (every rank's writes must be finished: call after a barrier)."""
    files = [f for f in tmp.iterdir() if f.is_file() and not f.name.startswith(".checksums-")]
    hashes = {f.name: {"sha256": _sha256(f), "bytes": f.stat().st_size} for f in _share(files)}
    (tmp / _PART.format(_rank_world()[0])).write_text(json.dumps(hashes))


def write_checksums(tmp: Path, extra: list[str]) -> None:
    """Rank 0, after every rank's :func:`hash_share`: merge them and hash ``extra`` (files written
    since) into ``tmp/checksums.json``."""
    hashes: dict[str, dict] = {}
    for part in sorted(tmp.glob(".checksums-rank*.json")):
        hashes.update(json.loads(part.read_text()))
        part.unlink()
    for name in extra:
        hashes[name] = {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size}
    (tmp / CHECKSUMS).write_text(json.dumps(dict(sorted(hashes.items())), indent=1))


def _problems(path: Path, names: list[str], recorded: dict) -> list[str]:
    out = []
    for name in names:
        f, want = path / name, recorded[name]
        if not f.is_file():
            out.append(f"{name} is missing")
        elif f.stat().st_size != want["bytes"]:
            out.append(f"{name} has {f.stat().st_size} bytes, {want['bytes']} when saved")
        elif _sha256(f) != want["sha256"]:
            out.append(f"{name} does not match its checksum (changed or damaged since it was saved)")
    return out


def find_damage(path: str | os.PathLike, collective: bool = True) -> str | None:
    """What is wrong with checkpoint ``path``'s files against its ``checksums.json`` (None: all
    match, or an older checkpoint without checksums, with a warning). ``collective``: every rank
    calls it and hashes its turn of the files (the answer is the same on every rank)."""
    path = Path(path)
    try:
        recorded = json.loads((path / CHECKSUMS).read_text())
    except FileNotFoundError:
        warnings.warn(f"{path} has no {CHECKSUMS} (saved by an older omniweave): its files are not verified",
                      stacklevel=2)
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return f"{path}: {CHECKSUMS} is not readable ({e})"
    names = sorted(recorded)
    together = collective and dist.is_available() and dist.is_initialized()
    found = _problems(path, _share(names) if together else names, recorded)
    if together:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, found)
        found = sorted(p for ps in everyone for p in ps)
    return f"{path}: {first_few(found, 3, '; ')}" if found else None


def verify(path: str | os.PathLike, collective: bool = True) -> None:
    """Raise :class:`CheckpointDamaged` if :func:`find_damage` finds anything."""
    problem = find_damage(path, collective)
    if problem:
        raise CheckpointDamaged(f"checkpoint {problem}")
