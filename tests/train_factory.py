"""Shared helpers for the trainer tests: a small packed demo dataset, recipe overrides, running
``omniweave train`` in-process or as a subprocess (torchrun), reading metrics and final weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from omniweave.cli import main as cli

REPO = Path(__file__).resolve().parents[1]
MAX_LEN = 512  # small packs keep a step well under a second on CPU


def make_demo_packed(root: Path, samples: int = 200, max_len: int = MAX_LEN, recipe: str = "demo") -> Path:
    """``omniweave data demo`` -> convert -> pack (``recipe``, ``max_len`` tokens): ~18 packs.
    With ``recipe="demo_omni"`` the data has the listening tasks too (``data demo --audio``)."""
    root = Path(root)
    audio = ["--audio"] if recipe == "demo_omni" else []
    assert cli(["data", "demo", str(root / "demo"), "--samples", str(samples), "--eval-samples", "8", *audio]) == 0
    return pack_jsonl(root / "demo" / "train.jsonl", root / "demo" / "media", root, max_len, "--recipe", recipe)


def pack_jsonl(jsonl: Path, media: Path, root: Path, max_len: int = MAX_LEN, *extra: str) -> Path:
    """convert + pack (the demo recipe unless ``extra`` names another with ``--recipe``)."""
    raw, packed = Path(root) / "raw", Path(root) / "packed"
    assert cli(["data", "convert", "--input", str(jsonl), "--media-dir", str(media), "--output", str(raw),
                "--workers", "1"]) == 0
    recipe = [] if "--recipe" in extra else ["--recipe", "demo"]
    assert cli(["data", "pack", "--input", str(raw), "--output", str(packed), *recipe,
                "--max-len", str(max_len), "--workers", "1", *extra]) == 0
    return packed


def overrides(packed: Path, out: Path, steps: int = 4, global_batch: int = 4, **kw) -> list[str]:
    """Hydra overrides for a short demo run on ``packed`` (``kw``: dotted keys with '__' for '.')."""
    ov = {"output_dir": out, "data.path": packed, "data.max_len": MAX_LEN, "train.steps": steps,
          "train.global_batch": global_batch, "train.warmup": 1, "train.save_interval": 0,
          "train.log_interval": 1, "train.eval_interval": 0}
    ov.update({k.replace("__", "."): v for k, v in kw.items()})
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in ov.items()]


def recipe(packed: Path, out: Path, name: str = "demo", **kw):
    """Recipe ``name`` (one that trains on the demo's packs: demo, demo_moe) with ``overrides``."""
    from omniweave.config import load_recipe

    return load_recipe(name, overrides(packed, out, **kw))


def train_in_process(packed: Path, out: Path, fault_hook=None, resume=None, name: str = "demo", **kw) -> dict:
    from omniweave.train.trainer import train

    return train(recipe(packed, out, name, **kw), resume=resume, fault_hook=fault_hook)


def child_env(**extra: str) -> dict:
    """Environment for a child process: this worktree first on PYTHONPATH, torchrun's vars cleared."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def train_cmd(packed: Path, out: Path, nproc: int = 1, resume: str | None = None, recipe: str = "demo",
              **kw) -> list[str]:  # fmt: skip
    cmd = [sys.executable, "-m", "omniweave", "train", recipe, *overrides(packed, out, **kw)]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    if resume:
        cmd += ["--resume", resume]
    return cmd


def train_subprocess(packed: Path, out: Path, nproc: int = 1, resume: str | None = None, timeout: float = 300,
                     env: dict | None = None, recipe: str = "demo", **kw) -> subprocess.CompletedProcess:
    """Run ``omniweave train`` (``--nproc N`` -> torchrun) in its own process group; kill it all on timeout."""
    proc = subprocess.Popen(train_cmd(packed, out, nproc, resume, recipe, **kw), env=env or child_env(), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, _ = proc.communicate()
        raise AssertionError(f"omniweave train (nproc={nproc}) did not finish in {timeout} s:\n{stdout[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, "")


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


def final_state(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a run's (or checkpoint's) model, loaded without a process group."""
    from omniweave.train.checkpoint import load_model

    model, _ = load_model(path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def run_clipping_spy(train_fn, cfg) -> tuple[dict, list[list[torch.Tensor]]]:
    """``train_fn(cfg)``'s result and the gradients the engine clipped at each optimizer step (full
    tensors, in parameter order), recorded by a spy on ``train/optim.clip_grad_norm``."""
    import omniweave.train.optim as optim

    grads: list = []
    original = optim.clip_grad_norm

    def clip(params, max_norm, **kw):
        grads.append([(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                      for p in params])
        return original(params, max_norm, **kw)

    optim.clip_grad_norm = clip
    try:
        return train_fn(cfg), grads
    finally:
        optim.clip_grad_norm = original


def run_named_grad_spy(train_fn, cfg) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    """``train_fn(cfg)``'s result and, per optimizer step, this rank's gradients by parameter name
    (full tensors; a pipeline rank's are its stages', under the model's names), recorded by a spy
    on the engine's update."""
    from omniweave.train.engine import Engine

    grads: list = []
    original = Engine._apply_update

    def spy(self, *a, **k):
        grads.append({n.replace("._checkpoint_wrapped_module", ""): (
            p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in self.model.named_parameters() if p.grad is not None})
        return original(self, *a, **k)

    Engine._apply_update = spy
    try:
        return train_fn(cfg), grads
    finally:
        Engine._apply_update = original


def trains_like_one_rank(root: Path, recipe: str, nproc: int, parallel: dict, steps: int = 3,
                         global_batch: int = 4) -> tuple[Path, Path]:
    """``omniweave train`` of ``recipe`` on the demo's data packed with it, on one rank and on
    ``nproc`` ranks with ``parallel`` (``parallel__pp=2`` …): asserts equal losses and grad norms
    (1e-5 relative) and a falling loss; returns the two run dirs (one rank's first) for the caller's
    weight checks."""
    import pytest

    packed = make_demo_packed(root / "data", samples=48, recipe=recipe)
    runs = []
    for n, kw in ((1, {}), (nproc, parallel)):
        out = root / f"n{n}" / "run"
        res = train_subprocess(packed, out, nproc=n, steps=steps, global_batch=global_batch, recipe=recipe, **kw)
        assert res.returncode == 0, res.stdout[-4000:]
        runs.append(out)
    ref, run = (read_metrics(r) for r in runs)
    assert [r["loss"] for r in run] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
    assert [r["grad_norm"] for r in run] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-5)
    assert losses(runs[0])[-1] < losses(runs[0])[0]
    return runs[0], runs[1]


def layout_against_one_process(cfg, row: dict, world: int, prepare=lambda model: None) -> dict:
    """One forward + backward of ``row`` through the model as the trainer builds it for recipe
    ``cfg`` on ``world`` ranks, and through the single-process model of the same seed (``prepare``
    applied to both): {model, reference, loss_rel, grad_rel, worst}. Every dp rank gets the same
    row, each normalised by the dp rows' loss tokens as the trainer does."""
    import copy

    import torch.distributed as dist

    from omniweave.config import to_dict
    from omniweave.models.registry import build_model
    from omniweave.parallel.context import shard_micro_batch
    from omniweave.parallel.dims import ParallelDims
    from omniweave.train.parallel_model import build

    torch.manual_seed(int(cfg.train.seed))  # what build() does on one process
    base = build_model(to_dict(cfg.model))
    base.init_weights()
    prepare(base)
    ref = copy.deepcopy(base)
    ref_loss = ref(row).loss_sum / row["num_loss_tokens"]
    ref_loss.backward()
    ref_loss = float(ref_loss.detach())
    dims = ParallelDims.from_config(cfg.parallel, world, model=cfg.model)
    meshes = dims.build_meshes("cpu")
    model = build(cfg, torch.device("cpu"), dims, meshes)
    prepare(model)
    res = model(shard_micro_batch(row, dims.cp, meshes.cp_rank, dims.tp))
    (res.loss_sum / (row["num_loss_tokens"] * dims.dp)).backward()
    loss = res.loss_sum.detach().double()
    dist.all_reduce(loss)
    loss = float(loss) / dims.tp / dims.dp / row["num_loss_tokens"]
    worst, name = worst_layout_grad(model, ref)
    return {"model": model, "reference": ref, "loss_rel": abs(loss - ref_loss) / ref_loss, "grad_rel": worst,
            "worst": name}


def worst_layout_grad(model, reference) -> tuple[float, str]:
    """(max over parameters of max |Δgrad| / max |grad|, its name) of a parallel ``model`` (its
    DTensor gradients gathered whole) against the single-process ``reference`` model."""
    ref = dict(reference.named_parameters())
    errors = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        r = ref[name].grad
        errors[name] = float((g - r).abs().max() / r.abs().max().clamp_min(1e-12))
    worst = max(errors, key=errors.get, default="")
    return errors.get(worst, 0.0), worst


def worst_grad_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """max over ``got``'s parameters of max |Δgrad| / max |grad| against ``want`` (same names)."""
    missing = sorted(set(got) - set(want))
    assert not missing, f"parameters the reference run lacks: {missing[:4]}"
    return max(float((g - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12)) for n, g in got.items())


def pack_fakes(root: Path, recipe_name: str, **counts) -> tuple:
    """tests/fakes_data samples (``counts``: n_text, n_image, n_video) packed with ``recipe_name``
    and collated: (the recipe on that pack, its collated batches, its stats.json)."""
    from omniweave.config import load_recipe, to_dict
    from omniweave.data.loading.loader import LOADER_ONLY_KEYS, collate_pack
    from omniweave.data.packing.packed import PackedDataset
    from tests.fakes_data import make_samples, write_raw

    root = Path(root)
    raw = write_raw(root / "raw", make_samples(rejects=False, **counts))
    assert cli(["data", "pack", "--input", str(raw), "--output", str(root / "packed"), "--recipe", recipe_name,
                "--workers", "1"]) == 0  # fmt: skip
    cfg = load_recipe(recipe_name, [f"data.path={root / 'packed'}"])
    data_cfg = {k: v for k, v in to_dict(cfg.data).items() if k not in LOADER_ONLY_KEYS}
    batches = [collate_pack(p, data_cfg) for p in PackedDataset(root / "packed")]
    return cfg, batches, json.loads((root / "packed" / "stats.json").read_text())
