"""``omniweave check`` rows for the parallel layouts: every CP attention mode, TP and EP on all local
devices, and FSDP2 with meta-device init, each against one device on the same global batch.

The model is the ``demo`` recipe's (a tiny Qwen2.5-VL; for EP its foundation swapped to the tiny
Qwen3-MoE, ``MOE_MODEL``), built and parallelised by
``parallel_model.build`` exactly as the trainer does it, in fp32, on two real packed rows that mix
text-only, image and video documents (generated into a temporary folder: ``omniweave data demo``
-> convert -> pack). The layouts run one after the other in one set of ranks (``run_ranks``); a
layout that raises, kills a rank or hangs is a FAIL row, and the ones after it go on in fresh ranks.

A layout passes when its loss and every parameter's gradient (the full tensor, gathered from the
shards) equal the single-device run's within ``limit`` (max |Δ| / max |ref| per tensor; the row
shows the worst). The FSDP2 meta-init layout first checks the weights ``parallel_model.build`` made on the
meta device: every parameter materialised (no meta tensor), finite and initialised (see
:func:`init_problems`); it then loads the single-device weights and is compared like the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import tempfile
from pathlib import Path
from typing import Iterator

import torch

from omniweave.check import Row, rel_err, verdict

GROUP = "parallel"
CPU_LIMIT = 1e-5  # gloo, fp32: what tests/dist holds every layout to
CUDA_LIMIT = 1e-4  # NCCL, fp32 with TF32 off: other reduction orders and kernels than one GPU
DEMO_SAMPLES, DEMO_MAX_LEN = 8, 256  # the fewest demo samples (seed 0) that pack into 2 rows with media,
# between them text-only, image and video documents
INIT_RMS_RTOL = 0.25  # a meta-initialised weight's RMS vs the one-device init (another random draw)
CORRUPTION = 1e-3  # relative change of every gradient of the layout a test names in ``corrupt``
# expert parallelism needs MoE layers: the demo model with its foundation swapped (one line of YAML)
MOE_MODEL = ("foundation@model.foundation=qwen3_moe_tiny",)
MOE_EXPERTS = 8  # qwen3_moe_tiny.yaml


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    overrides: tuple[str, ...]  # recipe overrides on top of the demo recipe
    meta_init: bool = False  # parallel_model.build's big-model path: meta device -> shard -> to_empty -> init
    skip: str = ""  # why this machine cannot run it
    model: tuple[str, ...] = ()  # overrides that change the model itself (its one-device reference too)


def layouts(world: int, model_cfg) -> list[Layout]:
    """The layouts that use ``world`` devices. Ulysses and TP split attention heads: where the demo
    model has fewer heads than devices they take the largest split it allows, dp the rest."""
    heads = math.gcd(int(model_cfg.foundation.num_heads), int(model_cfg.image_encoder.num_heads))
    split = max(d for d in range(1, world + 1) if world % d == 0 and heads % d == 0)
    no_split = "" if split > 1 else f"the demo model's {heads} attention heads do not split over {world} devices"
    split = split if split > 1 else world  # (then skipped)
    dp = f" x dp={world // split}" if split < world else ""

    def cp(mode: str, size: int, *extra: str) -> tuple[str, ...]:
        return (f"parallel.cp={size}", f"parallel.cp_attention={mode}", "parallel.vision_split=true", *extra)

    out = [Layout(f"cp={world} {mode}, vision split", cp(mode, world)) for mode in ("ring", "allgather")]
    out.append(Layout(f"cp={split} ulysses{dp}, vision split", cp("ulysses", split), skip=no_split))
    if world >= 4 and world % 2 == 0:
        out.append(Layout(f"cp={world} hybrid (ulysses 2), vision split", cp("hybrid", world, "parallel.cp_ulysses=2")))
    out.append(Layout(f"tp={split}{dp} foundation + image encoder",
                      (f"model.foundation.tp={split}", f"model.image_encoder.tp={split}"), skip=no_split))
    out.append(Layout(f"fsdp2 dp={world}, meta-device init", (), meta_init=True))
    out.append(Layout(f"ep={world} experts (qwen3-moe foundation)", (f"parallel.ep={world}",), model=MOE_MODEL,
                      skip="" if MOE_EXPERTS % world == 0 else f"{MOE_EXPERTS} experts do not split over {world} devices"))
    return out


def recipe(layout: Layout | None = None, model: tuple[str, ...] = ()):
    """The demo recipe in fp32 with ``layout``'s overrides (its model's), or with ``model`` alone."""
    from omniweave.config import load_recipe

    overrides = (*layout.model, *layout.overrides) if layout else model
    return load_recipe("demo", ["train.precision=fp32", *overrides])


@contextlib.contextmanager
def exact_fp32():
    """TF32 off (matmuls and cuDNN convolutions in full fp32) while comparing; restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ---------------------------------------------------------------------------- data


def _cli(*argv: str) -> None:
    from omniweave.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):  # progress bars would break the table
        code = main(list(argv))
    if code:
        raise RuntimeError(f"omniweave {' '.join(argv[:2])} failed (exit {code}): {out.getvalue()[-1000:]}")


def demo_rows(root: Path, n: int = 2) -> list[dict]:
    """The ``n`` packed demo rows with the most media items, as the loader hands them to the model."""
    from omniweave.data.demo import generate
    from omniweave.data.loading.loader import collate_pack
    from omniweave.data.packing.packed import PackedDataset

    generate(root / "demo", samples=DEMO_SAMPLES, eval_samples=0, rl_samples=0)
    _cli("data", "convert", "--input", str(root / "demo" / "train.jsonl"), "--media-dir", str(root / "demo" / "media"),
         "--output", str(root / "raw"), "--workers", "1", "--strict")
    _cli("data", "pack", "--input", str(root / "raw"), "--output", str(root / "packed"), "--recipe", "demo",
         "--max-len", str(DEMO_MAX_LEN), "--workers", "1")
    ds = PackedDataset(root / "packed")
    order = sorted(range(len(ds)), key=lambda i: (-len(ds.record(i)["media"]), i))[:n]
    if len(order) < n or not all(ds.record(i)["media"] for i in order):
        raise RuntimeError(f"the demo pack has fewer than {n} rows with media")
    return [collate_pack(ds[i], ds.manifest["data_cfg"]) for i in order]


def describe_batch(batch: list[dict]) -> str:
    docs = sum(len(r["cu_seqlens"]) - 1 for r in batch)
    media = sum(len(r["grid_thw"]) for r in batch)
    videos = sum(int((r["grid_thw"][:, 0] > 1).sum()) for r in batch)  # an image is one temporal patch
    return f"{len(batch)} rows: {docs} docs, {media - videos} images, {videos} video(s)"


def global_batch(rows: list[dict], dp: int) -> list[dict]:
    """Every row, repeated until each of the ``dp`` groups gets as many (dp group g takes rows
    g, g + dp, ... as its micro-batches)."""
    return [rows[i % len(rows)] for i in range(-(-len(rows) // dp) * dp)]


# ---------------------------------------------------------------------------- one device


def initial_weights(model: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The demo model's (with ``model`` overrides) weights as ``parallel_model.build`` initialises them on
    every rank (seeded, on the CPU) for a model below the meta-init threshold."""
    from omniweave.config import to_dict
    from omniweave.models.registry import build_model

    cfg = recipe(model=model)
    with torch.random.fork_rng(devices=[]):  # leaves the caller's RNG as it was
        torch.manual_seed(int(cfg.train.seed))
        model = build_model(to_dict(cfg.model))
        model.init_weights()
    return {k: v.detach() for k, v in model.state_dict().items()}


def reference(weights: dict[str, torch.Tensor], batch: list[dict], device: torch.device,
              model_overrides: tuple[str, ...] = ()) -> dict:
    """Loss and gradients on one device: the loss summed over ``batch`` and divided by its loss tokens."""
    from omniweave.config import to_dict
    from omniweave.models.hf.loading import assign_state_dict
    from omniweave.models.registry import build_model
    from omniweave.train.engine import to_device

    with torch.device("meta"):
        model = build_model(to_dict(recipe(model=model_overrides).model))
    assign_state_dict(model, {k: v.clone() for k, v in weights.items()}, "the initial weights")
    model.to(device)
    with exact_fp32():
        n = sum(r["num_loss_tokens"] for r in batch)
        loss = sum(model(to_device(r, device)).loss_sum for r in batch) / n
        loss.backward()
    return {"loss": float(loss.detach()), "grads": {k: p.grad.detach().cpu() for k, p in model.named_parameters()}}


# ---------------------------------------------------------------------------- ranks


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def init_problems(model: torch.nn.Module, init_state: dict[str, torch.Tensor]) -> list[str]:
    """Collective. What is wrong with the weights of a model materialised from the meta device:
    a tensor still on meta, a non-finite value, or a parameter not initialised like the one-device
    model: a constant there (norm weights 1, biases 0) must be equal here; a random one must have
    its RMS within ``INIT_RMS_RTOL`` (not so a shard left as ``to_empty`` memory) and, on an
    accelerator, (nearly) all values distinct: DTensor's RNG gives each shard its own part of one
    random stream there. On CPU meshes it does not (``is_rng_supported_mesh``): each rank draws
    from its own generator, so ranks seeded alike draw equal shards, and that is not checked."""
    import torch.distributed as dist

    local = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if _local(t).is_meta:
            local.append(f"{name} is on the meta device")
        elif not torch.isfinite(_local(t)).all():
            local.append(f"{name} is not finite")
    gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, local)
    problems = sorted({p for rank_problems in gathered for p in rank_problems})
    if problems:  # full tensors of meta shards cannot be gathered
        return problems
    for name, p in model.named_parameters():
        got, ref = _full(p).detach().double().cpu(), init_state[name].double()
        if ref.numel() == 1 or ref.std() == 0:
            if not torch.equal(got, ref):
                problems.append(f"{name} should be {float(ref.flatten()[0]):g} everywhere")
        else:
            rms, ref_rms = float(got.square().mean().sqrt()), float(ref.square().mean().sqrt())
            distinct = got.unique().numel() / got.numel() if p.device.type != "cpu" else 1.0
            if abs(rms - ref_rms) > INIT_RMS_RTOL * ref_rms or distinct < 0.99:
                problems.append(f"{name}: RMS {rms:.3g} (one device {ref_rms:.3g}), {distinct:.0%} distinct values")
    return problems


def _layout_on_rank(rank: int, world: int, layout: Layout, rows: list[dict], weights: dict,
                    corrupt: bool) -> dict | None:
    """One training step's forward and backward of the global batch under ``layout``; rank 0
    returns the loss and the gathered gradients (every rank takes part in the gathers)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
    )

    from omniweave.parallel.context import shard_micro_batch
    from omniweave.parallel.dims import ParallelDims
    from omniweave.parallel.spawn import rank_device
    from omniweave.train.engine import to_device
    from omniweave.train.parallel_model import META_INIT_PARAMS, build

    device = rank_device()
    with exact_fp32():
        cfg = recipe(layout)
        dims = ParallelDims.from_config(cfg.parallel, world, model=cfg.model)
        meshes = dims.build_meshes(device.type)
        model = build(cfg, device, dims, meshes, meta_init_params=0 if layout.meta_init else META_INIT_PARAMS)
        if layout.meta_init:
            problems = init_problems(model, weights)  # the same list on every rank
            if problems:
                return {"init_problems": problems, "dp": dims.dp} if rank == 0 else None
            # the one-device weights, to compare loss and gradients
            set_model_state_dict(model, {k: v.to(device) for k, v in weights.items()},
                                 options=StateDictOptions(full_state_dict=True))
        batch = global_batch(rows, dims.dp)
        n = sum(r["num_loss_tokens"] for r in batch)
        micro_batches = batch[meshes.dp_rank::dims.dp]
        loss = torch.zeros((), dtype=torch.float64, device=device)
        for i, row in enumerate(micro_batches):  # as Engine.optimizer_step does it
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            out = model(to_device(shard_micro_batch(row, dims.cp, meshes.cp_rank, dims.tp), device))
            (out.loss_sum / n).backward()  # FSDP sums the gradients over the ranks
            loss += out.loss_sum.detach().double()
        dist.all_reduce(loss)  # a tp foundation's loss is replicated on its tp ranks
        grads = {}
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            if corrupt:  # a test's stand-in for a layout that computes wrong gradients
                _local(p.grad).mul_(1 + CORRUPTION)
            grads[name] = _full(p.grad).detach().cpu()
    if rank:
        return None
    return {"loss": float(loss) / dims.tp / n, "grads": grads, "dp": dims.dp}


# ---------------------------------------------------------------------------- rows


def compare(layout: Layout, got: dict, ref: dict, limit: float, note: str) -> Row:
    if got.get("init_problems"):
        problems = got["init_problems"]
        return Row(GROUP, layout.name, "FAIL", note=f"{len(problems)} problem(s) after meta init: "
                   + "; ".join(problems[:3]))
    missing = sorted(set(ref["grads"]) - set(got["grads"]))
    if missing:
        return Row(GROUP, layout.name, "FAIL", note=f"no gradient for {len(missing)} parameter(s): {missing[:3]}")
    errors = {name: rel_err(got["grads"][name], g) for name, g in ref["grads"].items()}
    loss_err = abs(got["loss"] - ref["loss"]) / abs(ref["loss"])
    worst_grad = max(errors, key=lambda k: (math.isnan(errors[k]), errors[k]))
    worst = float(torch.tensor([loss_err, *errors.values()]).max())  # NaN stays NaN (fails)
    checked = "materialised, finite, initialised; then " if layout.meta_init else ""
    return verdict(GROUP, layout.name, worst, limit,
                   f"{checked}loss {loss_err:.1e}, {len(errors)} grads (worst {errors[worst_grad]:.1e} "
                   f"{worst_grad}); {note}")


def _failure(e: Exception) -> str:
    """The last line of a rank's traceback (the exception), else the message's first line."""
    text = str(e)
    if " failed:\n" in text:
        head, trace = text.split(" failed:\n", 1)
        lines = [ln for ln in trace.split("--- rank")[0].splitlines() if ln.strip()]
        return f"{head.strip()}: {lines[-1].strip() if lines else '?'}"
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _layouts_on_rank(rank: int, world: int, chosen: list[Layout], rows: list[dict], weights: dict,
                     corrupt: str | None, out_dir: str) -> None:
    """Every layout of ``chosen`` in turn; rank 0 saves each one's result as it finishes, so that
    the results before a layout that fails are kept."""
    for i, layout in enumerate(chosen):
        result = _layout_on_rank(rank, world, layout, rows, weights[layout.model], layout.name == corrupt)
        if rank == 0:
            torch.save(result, Path(out_dir) / f"{i}.pt")


def run_layouts(device: torch.device, world: int, chosen: list[Layout], rows: list[dict], weights: dict,
                corrupt: str | None, timeout: float) -> Iterator[tuple[Layout, dict | Exception]]:
    """(layout, rank 0's result or the failure) for each of ``chosen``. They run one after the other
    in one set of ranks (starting ranks costs more than a layout); after a layout that fails
    (raises, a rank dies, or hangs past ``timeout`` seconds per layout) the rest go on in fresh ranks."""
    from omniweave.parallel.spawn import run_ranks

    pending = list(chosen)
    while pending:
        error: Exception | None = None
        with tempfile.TemporaryDirectory(prefix="omniweave-check-") as out_dir:
            try:
                run_ranks(_layouts_on_rank, world, pending, rows, weights, corrupt, out_dir,
                          timeout=timeout * len(pending), device=device.type, quiet=True)
            except Exception as e:  # noqa: BLE001 - reported on the layout that did not finish
                error = e
            done = [torch.load(p, weights_only=True) for i in range(len(pending))
                    if (p := Path(out_dir) / f"{i}.pt").exists()]
        yield from zip(pending, done)
        if len(done) == len(pending):
            return
        yield pending[len(done)], error or RuntimeError("no result")
        pending = pending[len(done) + 1:]


def layout_rows(device: torch.device, world: int, chosen: list[Layout], corrupt: str | None = None,
                timeout: float = 120.0) -> Iterator[Row]:
    """A row per layout in ``chosen`` on ``world`` ranks of ``device``. ``corrupt``: the name of a
    layout whose gradients every rank scales by 1 + CORRUPTION after backward; a seam for the tests
    (a wrong layout must FAIL), ``omniweave check`` never sets it."""
    limit = CPU_LIMIT if device.type == "cpu" else CUDA_LIMIT
    with tempfile.TemporaryDirectory(prefix="omniweave-check-") as tmp:
        rows = demo_rows(Path(tmp))
    runnable = [lay for lay in chosen if not lay.skip]
    weights = {m: initial_weights(m) for m in {lay.model for lay in runnable}}  # model overrides -> weights
    refs: dict[tuple, dict] = {}  # (model, global batch size) -> the one-device run of that batch
    results = run_layouts(device, world, runnable, rows, weights, corrupt, timeout)
    for layout in chosen:
        if layout.skip:
            yield Row(GROUP, layout.name, "skip", note=layout.skip)
            continue
        _, result = next(results)  # in the same order
        try:
            if isinstance(result, Exception):
                raise result
            batch = global_batch(rows, result["dp"])
            key = (layout.model, len(batch))
            if key not in refs:
                refs[key] = reference(weights[layout.model], batch, device, layout.model)
            row = compare(layout, result, refs[key], limit, describe_batch(batch) + ", fp32")
        except Exception as e:  # noqa: BLE001 - a layout that fails is a FAIL row; the others still run
            row = Row(GROUP, layout.name, "FAIL", note=_failure(e))
        if device.type != "cpu" and row.limit:
            row = dataclasses.replace(row, limit=f"{row.limit} TF32 off")
        yield row


def local_world(device: torch.device, quick: bool) -> int:
    """All local devices on an accelerator; on CPU 2 gloo ranks with ``quick``, else 4."""
    if device.type == "cpu":
        return 2 if quick else 4
    return getattr(torch, device.type).device_count()


def rows(device: torch.device, quick: bool) -> Iterator[Row]:
    world = local_world(device, quick)
    chosen = layouts(max(world, 2), recipe().model)
    if world < 2:
        for layout in chosen:
            yield Row(GROUP, layout.name, "skip", note=f"one device: {layout.name} needs 2 or more")
        return
    yield from layout_rows(device, world, chosen)
