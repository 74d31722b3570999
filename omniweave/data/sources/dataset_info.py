"""LLaMA-Factory dataset registries: ``omniweave data convert --dataset-info PATH --dataset A,B``.

A ``dataset_info.json`` maps dataset names to entries (LLaMA-Factory's data/README.md)::

    "mllm_demo": {"file_name": "mllm_demo.json", "formatting": "sharegpt",
                  "columns": {"messages": "messages", "images": "images"},
                  "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                           "assistant_tag": "assistant"}}

Each named entry becomes a ``RegistryDataset``: its data files and the ``Mapping`` its rows are
read with. ``file_name`` is a file or a folder of files, relative to the json's folder;
``formatting`` is alpaca (the default), sharegpt or openai; ``ranking: true`` makes every row a
preference pair; LLaMA-Factory's column keys map onto ours (``prompt`` -> instruction, ``query`` ->
input, ``response`` -> output, the others by the same name). Columns an entry leaves out keep
omniweave's defaults (``images``, ``videos``, ``audios``, ``tools``; alpaca's ``system`` and
``history`` too), so a standard column LLaMA-Factory would ignore unmapped is read, not dropped.
Entries served from elsewhere (``hf_hub_url``, ``ms_hub_url``, ``om_hub_url``, ``script_url``,
``cloud_file_name``) and what convert cannot honour (a ``split`` other than train, ``num_samples``,
files that are not JSON / JSONL) are a ``UserError`` naming the dataset and why.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from omniweave.data.sources.mapping import TAG_FIELDS, Mapping
from omniweave.errors import UserError, first_few

# LLaMA-Factory's column keys -> Mapping fields; ``id`` and ``solution`` are omniweave's own
COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "history": "history",
           "messages": "messages", "system": "system", "tools": "tools", "images": "images", "videos": "videos",
           "audios": "audios", "chosen": "chosen", "rejected": "rejected", "kto_tag": "kto_tag",
           "id": "id", "solution": "solution"}
# where LLaMA-Factory would load the dataset from, in its order of precedence (parser.get_dataset_list)
REMOTE = {"hf_hub_url": "the Hugging Face hub", "ms_hub_url": "the ModelScope hub", "om_hub_url": "the Modelers hub",
          "script_url": "a dataset loading script", "cloud_file_name": "cloud storage (s3 / gcs)"}
HUB_ONLY = ("subset", "folder", "revision")  # only for a hub or a script: a local file ignores them, as there
ENTRY_KEYS = ("file_name", "formatting", "ranking", "split", "num_samples", "columns", "tags", *REMOTE, *HUB_ONLY)
FORMATTINGS = ("alpaca", "sharegpt", "openai")
READABLE = (".json", ".jsonl")


@dataclass(frozen=True)
class RegistryDataset:
    name: str
    files: tuple[str, ...]  # its data files, in order (a folder's files sorted by name)
    mapping: Mapping  # resolved: every row of every file is read with it
    root: str  # the dataset_info.json's folder: file_name and (by default) media paths are relative to it


def check_flags(args) -> None:
    """``--input`` xor ``--dataset-info`` (which needs ``--dataset`` and takes no mapping flags)."""
    from omniweave.data.sources.mapping import COLUMN_FIELDS

    if args.dataset and not args.dataset_info:
        raise UserError("--dataset names entries of a LLaMA-Factory dataset_info.json: pass --dataset-info PATH too")
    if not args.dataset_info:
        if not args.input:
            raise UserError("nothing to convert: pass --input FILE [FILE ...] or --dataset-info PATH --dataset NAME")
        return
    if not args.dataset:
        raise UserError(f"--dataset-info {args.dataset_info} needs --dataset NAME[,NAME...]: the entries to convert")
    given = (["--input"] if args.input else []) + (["--mapping"] if args.mapping else []) \
        + ([f"--format {args.format}"] if args.format != "auto" else []) \
        + [f"--{k.replace('_', '-')}-key" for k in COLUMN_FIELDS if getattr(args, f"{k}_key", None) is not None] \
        + [f"--{k.replace('_', '-')}" for k in TAG_FIELDS if getattr(args, k, None) is not None]
    if given:
        raise UserError(f"--dataset-info reads each dataset's files, formatting, columns and tags from its entry; "
                        f"it cannot be combined with {', '.join(given)}")


def select(path: str | Path, names: str) -> list[RegistryDataset]:
    """The entries ``names`` (comma-separated) of the dataset_info.json at ``path``, in that order."""
    path = Path(path)
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"--dataset-info {path}: no such file") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"--dataset-info {path} is not valid JSON ({e})") from None
    if not isinstance(info, dict):
        raise UserError(f"--dataset-info {path} must hold an object of dataset name -> entry, got {type(info).__name__}")
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    if not wanted:
        raise UserError("--dataset names no dataset")
    twice = sorted(n for n, k in Counter(wanted).items() if k > 1)
    if twice:
        raise UserError(f"--dataset names {', '.join(twice)} more than once")
    unknown = [n for n in wanted if n not in info]
    if unknown:
        raise UserError(f"{path} has no dataset {', '.join(map(repr, unknown))}; it has: {first_few(sorted(info), 30)}")
    return [registry_dataset(path, n, info[n]) for n in wanted]


def registry_dataset(path: Path, name: str, entry) -> RegistryDataset:
    where = f"{path}: dataset {name!r}"
    if not isinstance(entry, dict):
        raise UserError(f"{where}: an entry must be an object, got {type(entry).__name__}")
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)}; an entry takes {', '.join(ENTRY_KEYS)}")
    remote = next((k for k in REMOTE if k in entry), None)
    if remote:
        also = f" (LLaMA-Factory ignores its file_name while {remote} is set)" if "file_name" in entry else ""
        raise UserError(f"{where} is loaded from {REMOTE[remote]} ({remote}: {entry[remote]!r}), which convert cannot "
                        f"read: it converts local files only. Download it and point the entry's file_name at the "
                        f"JSON / JSONL{also}")
    if not isinstance(entry.get("file_name"), str) or not entry["file_name"]:
        raise UserError(f"{where} has no file_name (a file or a folder next to {path.name})")
    if entry.get("split", "train") != "train":
        raise UserError(f"{where}: split {entry['split']!r}: a local file has only the train split")
    if entry.get("num_samples") is not None:
        raise UserError(f"{where}: num_samples (LLaMA-Factory draws that many rows at random when training) is not "
                        "done by convert, which converts every row; remove it from the entry or cut the file")
    root = path.parent
    return RegistryDataset(name, data_files(root, entry["file_name"], where), entry_mapping(entry, where), str(root))


def entry_mapping(entry: dict, where: str = "the entry") -> Mapping:
    """An entry's ``formatting`` / ``ranking`` / ``columns`` / ``tags`` as a resolved ``Mapping``."""
    fmt = entry.get("formatting", "alpaca")
    if fmt not in FORMATTINGS:
        raise UserError(f"{where}: formatting {fmt!r}; LLaMA-Factory's formattings are {', '.join(FORMATTINGS)}")
    ranking = entry.get("ranking", False)
    if not isinstance(ranking, bool):
        raise UserError(f"{where}: ranking must be true or false, got {ranking!r}")
    fields: dict[str, str] = {}
    for section, valid in (("columns", COLUMNS), ("tags", {t: t for t in TAG_FIELDS})):
        values = entry.get(section) or {}
        if not isinstance(values, dict):
            raise UserError(f"{where}: {section} must be an object, got {type(values).__name__}")
        for key, value in values.items():
            if key not in valid:
                raise UserError(f"{where}: unknown {section} key {key!r}; {section} takes {', '.join(valid)}")
            if value is None:  # LLaMA-Factory's "not this column": ours keeps its default
                continue
            if not isinstance(value, str) or not value:
                raise UserError(f"{where}: {section}.{key} must be a name, got {value!r}")
            if section == "columns" or fmt != "alpaca":  # alpaca has no turns to tag (LLaMA-Factory ignores them)
                fields[valid[key]] = value
    return Mapping(format=fmt, ranking=ranking, **fields).resolved(fmt)


def data_files(root: Path, file_name: str, where: str) -> tuple[str, ...]:
    """``file_name`` (relative to ``root``): a file, or a folder whose files (hidden ones aside) are the data."""
    path = root / file_name
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if not p.name.startswith("."))
        if not files:
            raise UserError(f"{where}: folder {path} holds no files")
    elif path.is_file():
        files = [path]
    else:
        raise UserError(f"{where}: file_name {file_name!r} not found ({path})")
    bad = [p.name for p in files if not p.is_file() or p.suffix.lower() not in READABLE]
    if bad:
        raise UserError(f"{where}: convert reads JSON / JSONL files; {first_few(bad, 3)} is not one (convert a csv, "
                        "parquet, arrow or txt dataset to JSONL first)")
    return tuple(str(p) for p in files)


def per_dataset(datasets: list[RegistryDataset], rows: Counter, rejects: list[dict]) -> dict:
    """convert_report.json's ``datasets``: per name its files and rows in, written and rejected (by reason)."""
    out = {}
    for ds in datasets:
        mine = [r["reason"] for r in rejects if r.get("dataset") == ds.name]
        out[ds.name] = {"files": list(ds.files), "input": rows[ds.name], "written": rows[ds.name] - len(mine),
                        "rejected": len(mine), "rejected_by_reason": dict(sorted(Counter(mine).items()))}
    return out
