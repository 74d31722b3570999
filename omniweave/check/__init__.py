"""``omniweave check [--device cuda] [--quick]``: prove this machine's accelerator path against the
reference, one table.

Groups of rows (each a module with ``rows(device, quick) -> Iterator[Row]``):

- ``kernels``   every attention backend vs ``math`` (fp32 / bf16, forward and backward, GQA, windows,
                documents of 1 token and long ones), ring block kernels, KV-cache decoding;
- ``models``    the vision towers and one decoder step per family in bf16 vs fp32;
- ``parallel``  the CP modes, TP and EP (a MoE foundation) on all local devices vs one device; FSDP2
                with meta-device init;
- ``speed``     a short training run: tokens/s and MFU against the measured matmul peak.

A row is ``pass``, ``FAIL`` or ``skip`` (with the reason: a backend this machine lacks, one device
only, ...). ``info`` rows report measurements without a verdict. The exit code is 1 when any row
failed (a group that crashes is a failed row carrying the exception), else 0. On a CPU-only
machine the same command runs the checks that apply there, so CI exercises it.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Iterator

import torch

GROUPS = ("kernels", "models", "parallel", "speed")


@dataclass
class Row:
    group: str
    name: str
    status: str  # pass | FAIL | skip | info
    value: str = ""  # what was measured
    limit: str = ""  # the tolerance or target it is held to
    note: str = ""  # a reason (skip / FAIL) or context

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"


def verdict(group: str, name: str, err: float, limit: float, note: str = "") -> Row:
    """A pass/FAIL row for a measured error (NaN fails)."""
    ok = err <= limit  # False for NaN
    return Row(group, name, "pass" if ok else "FAIL", f"{err:.2e}", f"<= {limit:.0e}", note)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| in float64 (the scale-free error every row reports)."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)) if ref.numel() else 0.0


def _group_rows(group: str, device: torch.device, quick: bool) -> Iterator[Row]:
    import importlib

    try:
        yield from importlib.import_module(f"omniweave.check.{group}").rows(device, quick)
    except Exception as e:  # noqa: BLE001 - a crashing group is a failed row, the table still prints
        last = traceback.extract_tb(e.__traceback__)[-1]
        yield Row(group, "(group crashed)", "FAIL", note=f"{type(e).__name__}: {e} [{last.filename}:{last.lineno}]")


def run_checks(device: torch.device, quick: bool, groups=GROUPS, echo=None) -> list[Row]:
    rows = []
    for group in groups:
        for row in _group_rows(group, device, quick):
            rows.append(row)
            if echo is not None:
                echo(row)
    return rows


WIDTHS = (9, 46, 6, 10, 10)


def format_row(row: Row) -> str:
    cells = (row.group, row.name, row.status, row.value, row.limit)
    return "  ".join(f"{c:<{w}}" for c, w in zip(cells, WIDTHS)) + (f"  {row.note}" if row.note else "")


def header() -> str:
    return format_row(Row("group", "check", "status", "value", "limit", "note")) + "\n" + "-" * 100


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: the accelerator if there is one)")
    p.add_argument("--quick", action="store_true", help="small shapes and a short run (about a minute on 2 CPU cores)")
    p.add_argument("--only", nargs="+", choices=GROUPS, default=list(GROUPS), help="run these groups only")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (f"{props.name} x{torch.cuda.device_count()}, CUDA {torch.version.cuda}, torch {torch.__version__}, "
                f"compute capability {props.major}.{props.minor}")
    return f"{device.type}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def run(args: argparse.Namespace) -> int:
    from omniweave.device import detect
    from omniweave.errors import UserError

    try:
        device = detect(args.device).device(0)
    except (ValueError, RuntimeError) as e:
        raise UserError(f"--device {args.device}: {e}") from None
    t0 = time.perf_counter()
    print(f"omniweave check on {describe(device)}{' (quick)' if args.quick else ''}")
    print(header(), flush=True)
    rows = run_checks(device, args.quick, args.only, echo=lambda r: print(format_row(r), flush=True))
    failed = [r for r in rows if r.failed]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": describe(device), "quick": args.quick, "rows": [asdict(r) for r in rows]}, f, indent=1)
    counts = {s: sum(r.status == s for r in rows) for s in ("pass", "FAIL", "skip", "info")}
    print("-" * 100)
    print(f"check: {counts['pass']} passed, {counts['FAIL']} failed, {counts['skip']} skipped, "
          f"{counts['info']} measured in {time.perf_counter() - t0:.0f} s"
          + (f"; FAILED: {', '.join(f'{r.group}/{r.name}' for r in failed)}" if failed else ""))
    return 1 if failed else 0
