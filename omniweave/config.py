"""Recipes: one YAML per run, composed with Hydra over one shared schema, overridable with ``key=value``.

A recipe names its components with a Hydra defaults list; the component groups live in
``omniweave/configs/models/<kind>/`` and are on the search path, e.g.::

    defaults:
      - image_encoder@model.image_encoder: qwen2_5_vit_tiny
      - projector@model.projector: patch_merger_tiny
      - foundation@model.foundation: qwen2_5_tiny
      - _self_

Every recipe is composed on top of :class:`RecipeSchema` (the typed dataclasses below): every key
the code reads has its default there, so a recipe holds only what it changes (a recipe that just
wires components is complete), any key can be overridden without Hydra's ``+``, a value of the
wrong type is an error, and an unknown key — in a recipe file or on the command line — is a
one-line :class:`RecipeError` naming the closest valid key. docs/training.md lists this schema
(a test keeps the two equal). ``model.*`` holds the components' own configs, checked by the
registry when the model is built.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import tempfile
import warnings
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from omniweave.errors import UserError

# the built-in recipes and component configs: package data, found from any working directory
CONFIGS_DIR = Path(os.environ.get("OMNIWEAVE_CONFIGS", Path(__file__).resolve().parent / "configs"))
SCHEMA_NODE = "_omniweave_schema"  # the schema's name in Hydra's ConfigStore
_ROOT = "_omniweave_root"  # the wrapper config: schema first, then the recipe, then the overrides


class RecipeError(UserError):
    """A recipe that cannot be composed: unknown recipe or key, a wrong type, a missing group option."""


def _vision_schema():
    """``data.vision``: every field of ``media.VisionConfig`` (null = its default, or the value in
    ``preprocessor_config``) plus ``preprocessor_config``, a HF model dir / JSON to read them from."""
    from omniweave.data.media.vision import VisionConfig

    def optional(f):
        kind = List[float] if "mean" in f.name or "std" in f.name else {"int": int, "float": float, "str": str, "bool": bool}[str(f.type)]
        return f.name, Optional[kind], field(default=None)

    return make_dataclass("VisionSchema", [("preprocessor_config", Optional[str], field(default=None)),
                                           *map(optional, fields(VisionConfig))])


def _audio_schema():
    """``data.audio``: the fields of ``audio.AudioConfig`` with its defaults."""
    from omniweave.data.media.audio import AudioConfig

    types = {"int": int, "float": float, "str": str, "bool": bool}
    return make_dataclass("AudioSchema", [(f.name, types[str(f.type)], field(default=f.default))
                                          for f in fields(AudioConfig)])


@dataclass
class VLADataSchema:  # data.vla: how a robot frame becomes a prompt (data/packing/vla.py, docs/vla.md)
    prompt: str = "Task: {task}, State: {state};\nAction: "
    state_bins: int = 256
    action_bins: int = 0
    cameras: Optional[List[str]] = None


@dataclass
class DiffusionDataSchema:  # data.diffusion: how a clip becomes latents (diffusion/data.py, docs/diffusion.md)
    frames: Optional[int] = 17  # frames per clip (4k + 1) from its start; null: native length up to max_frames
    max_frames: int = 81
    fps: Optional[float] = None  # sample frames at this rate (null: every frame)
    max_pixels: int = 399360  # H x W cap (832 x 480), aspect kept, never upscaled, sides multiples of 16
    min_pixels: int = 256
    latents_dtype: str = "float32"  # float32 | float16: what the packs store
    text_len: int = 512  # the text encoder's max_sequence_length
    codecs: Optional[Any] = None  # set by omniweave (the recipe's model.vae / text_encoder / patch), never by hand


@dataclass
class DataSchema:
    path: Optional[str] = MISSING  # packed dataset (omniweave data pack); null with data.mix
    mix: Optional[List[Any]] = None  # or several: [{path, weight | epochs, name}] (data/loading/mix.py)
    num_workers: int = 0
    balance: Optional[str] = None
    balance_refit: int = 20
    tokenizer: str = "demo"
    template: str = "chatml"
    max_len: int = 4096
    truncation: str = "drop"
    special_tokens_in_text: str = "reject"
    mask_history: bool = False
    train_on_prompt: bool = False
    rope: str = "mrope"
    vision: Any = field(default_factory=lambda: _vision_schema()())
    audio: Any = field(default_factory=lambda: _audio_schema()())
    vla: Any = field(default_factory=lambda: VLADataSchema())  # train.phase=vla (data/packing/vla.py)
    diffusion: Any = field(default_factory=lambda: DiffusionDataSchema())  # train.phase=diffusion (diffusion/data.py)


@dataclass
class DPOSchema:  # train.phase=dpo (docs/dpo.md)
    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0
    ref: str = "model"
    ref_path: Optional[str] = None


@dataclass
class ORPOSchema:  # train.phase=orpo (docs/dpo.md)
    beta: float = 0.1


@dataclass
class SimPOSchema:  # train.phase=simpo (docs/dpo.md)
    beta: float = 2.0
    gamma: float = 0.5
    label_smoothing: float = 0.0
    nll_weight: float = 0.0


@dataclass
class KTOSchema:  # train.phase=kto (docs/dpo.md)
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    loss: str = "kto"


@dataclass
class VLATrainSchema:  # train.phase=vla (docs/vla.md)
    text_weight: float = 0.0  # co-training: the labelled text tokens' cross-entropy, weighted against action values


@dataclass
class DiffusionTrainSchema:  # train.phase=diffusion: the rectified-flow objective (diffusion/objective.py)
    shift: float = 3.0  # timestep shift of the training table (Wan: 3 at 480p, 5 at 720p)
    timestep_sampling: str = "uniform"  # uniform | logit_normal | mode
    logit_mean: float = 0.0
    logit_std: float = 1.0
    loss_weighting: str = "none"  # none | bell | sigma_sqrt | cosmap
    caption_dropout: float = 0.1  # a clip's caption replaced by the encoded empty prompt (for CFG)


@dataclass
class TrainSchema:
    phase: str = "sft"
    steps: int = MISSING
    global_batch: int = MISSING
    lr: float = MISSING
    min_lr_ratio: float = 0.0
    warmup: int = 0
    schedule: str = "cosine"
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 0.0
    precision: str = "fp32"
    cpu_threads: Optional[int] = None
    ac: str = "none"
    offload: str = "none"
    seed: int = 0
    init_from: Optional[str] = None
    save_interval: int = 0
    keep_last: int = 0
    async_save: bool = False
    collective_timeout: float = 600.0
    log_interval: int = 1
    max_bad_steps: int = 5
    eval_interval: int = 0
    save_hf: bool = False
    dpo: DPOSchema = field(default_factory=DPOSchema)
    orpo: ORPOSchema = field(default_factory=ORPOSchema)
    simpo: SimPOSchema = field(default_factory=SimPOSchema)
    kto: KTOSchema = field(default_factory=KTOSchema)
    vla: VLATrainSchema = field(default_factory=VLATrainSchema)
    diffusion: DiffusionTrainSchema = field(default_factory=DiffusionTrainSchema)


@dataclass
class EvalSchema:
    path: Optional[str] = None
    media_dir: Optional[str] = None
    max_samples: Optional[int] = None
    max_new_tokens: int = 8
    batch_size: int = 16


@dataclass
class ParallelSchema:
    dp: int = -1
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    cp_attention: str = "ring"
    cp_ulysses: int = 1
    cp_head_groups: int = 1
    vision_split: bool = True
    ep: int = 1
    pp: int = 1
    pp_layers: Optional[List[int]] = None
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    seq_chunks: int = 1


@dataclass
class RolloutSchema:  # rl.rollout: the engine that samples (docs/rl.md "Rollout engines")
    engine: str = "native"  # native (generation.py) | vllm (rl/vllm_engine.py)
    correction: str = "auto"  # none | recompute | token_tis | seq_tis; auto: none on native on-policy, else token_tis
    tis_cap: float = 2.0  # truncation C of the importance weight min(pi_old / mu, C)
    gpu_memory_utilization: float = 0.3  # vllm: its share of device memory (on CPU: of RAM for its KV cache)
    max_model_len: Optional[int] = None  # vllm: null = data.max_len + rl.max_new_tokens
    enforce_eager: bool = True  # vllm: no CUDA graphs (their capture costs memory and start-up time)
    sleep: bool = False  # vllm on GPUs: free its KV cache (level 1) between rollouts, for the update's memory
    max_images: int = 8  # vllm: images / videos one prompt may hold
    max_videos: int = 2
    off_policy: int = 0  # 1: update on the batch the previous step's policy sampled (rl/schedule.py)
    overlap: bool = True  # off_policy 1: sample in a background thread during the update (engines without collectives)


@dataclass
class RLSchema:  # GRPO (omniweave rl; docs/rl.md)
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    rewards: List[Any] = field(default_factory=lambda: [{"name": "exact_match", "weight": 1.0}])
    scale_rewards: bool = True
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: Optional[float] = 3.0
    kl_coef: float = 0.0
    loss_agg: str = "token-mean"
    filter_zero_std: bool = True
    advantage: str = "grpo"
    importance_sampling: str = "token"
    ppo_epochs: int = 1
    mini_batches: int = 1
    update_max_len: Optional[int] = None
    rollout: RolloutSchema = field(default_factory=RolloutSchema)


@dataclass
class DemoSchema:
    samples: int = 4000
    eval_samples: int = 200
    audio: bool = False  # add the listening tasks (data demo --audio): for recipes with an audio_encoder


@dataclass
class RecipeSchema:
    output_dir: Optional[str] = None  # null: runs/<recipe name>
    model: Dict[str, Any] = field(default_factory=dict)
    data: DataSchema = field(default_factory=DataSchema)
    train: TrainSchema = field(default_factory=TrainSchema)
    eval: EvalSchema = field(default_factory=EvalSchema)
    parallel: ParallelSchema = field(default_factory=ParallelSchema)
    rl: RLSchema = field(default_factory=RLSchema)
    demo: DemoSchema = field(default_factory=DemoSchema)


def schema_defaults() -> dict[str, Any]:
    """Every schema key (dotted, ``model`` excluded) -> its default (``'???'`` where required)."""
    cfg = OmegaConf.structured(RecipeSchema)
    return {k: v for k, v in _flatten(OmegaConf.to_container(cfg, resolve=False)).items() if not k.startswith("model")}


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict) or not d:
        return {prefix.rstrip("."): d} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in d.items():
        out.update(_flatten(value, f"{prefix}{key}."))
    return out


def builtin_recipe_paths() -> list[Path]:
    """The built-in recipes' files, sorted by name (``omniweave recipes`` describes them)."""
    return sorted((CONFIGS_DIR / "recipes").glob("*.yaml"))


def recipe_path(name_or_path: str | os.PathLike) -> Path:
    """A recipe file path, or the name of a built-in recipe in ``omniweave/configs/recipes/``."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p.resolve()
    builtin = CONFIGS_DIR / "recipes" / f"{p.stem}.yaml"
    if builtin.exists():
        return builtin
    names = [q.stem for q in builtin_recipe_paths()]
    close = difflib.get_close_matches(p.stem, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise RecipeError(f"recipe {str(name_or_path)!r} not found: not a YAML file, nor a built-in recipe; {hint}"
                      f"built-in: {', '.join(names)} (omniweave recipes describes them)")


def _register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NODE, node=RecipeSchema)


def _compose(path: Path, overrides: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    _register_schema()
    search = [f"file://{path.parent}", f"file://{CONFIGS_DIR / 'models'}", f"file://{CONFIGS_DIR}"]
    GlobalHydra.instance().clear()
    # megatron-energon installs a Hydra search-path plugin (multistorageclient) that logs a
    # traceback whenever it has no profile configured; it has nothing to do with recipes.
    logging.getLogger("multistorageclient").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory() as root:
        Path(root, f"{_ROOT}.yaml").write_text(f"defaults:\n  - {SCHEMA_NODE}\n  - /{path.stem}\n  - _self_\n")
        try:
            with warnings.catch_warnings(), initialize_config_dir(config_dir=root, version_base=None):
                warnings.filterwarnings("ignore", message=r"provider=msc")
                return compose(config_name=_ROOT, overrides=[*overrides, f"hydra.searchpath=[{','.join(search)}]"])
        finally:
            GlobalHydra.instance().clear()


def load_recipe(name_or_path: str | os.PathLike, overrides: Iterable[str] = ()) -> DictConfig:
    """Compose a recipe over the schema and apply ``key=value`` overrides; returns a resolved config
    (not in struct mode, so code may add run-time keys). Raises :class:`RecipeError` for user mistakes."""
    path = recipe_path(name_or_path)
    overrides = list(overrides)
    try:
        cfg = _compose_with_component_fields(path, overrides)
        OmegaConf.resolve(cfg)
    except Exception as e:  # noqa: BLE001 - Hydra/OmegaConf raise many types; each becomes one line
        if isinstance(e, UserError):
            raise
        raise RecipeError(_explain(e, path)) from e
    OmegaConf.set_struct(cfg, False)
    cfg.pop("hydra", None)
    if cfg.output_dir is None:
        cfg.output_dir = f"runs/{path.stem}"
    check_ranges(cfg)
    return cfg


# the least value of each numeric key (a key of -1 in AUTO means "work it out" and is allowed too;
# parallel.pp and parallel.seq_chunks are left to their own checks, whose messages say more),
# and the few that are fractions; a value out of range is one line here, not a crash mid-run
LEAST = {
    "train.steps": 1, "train.global_batch": 1, "train.lr": 0, "train.warmup": 0, "train.weight_decay": 0,
    "train.eps": 0, "train.grad_clip": 0, "train.cpu_threads": 1, "train.save_interval": 0, "train.keep_last": 0,
    "train.collective_timeout": 1, "train.log_interval": 1, "train.max_bad_steps": 1, "train.eval_interval": 0,
    "train.dpo.beta": 0, "data.max_len": 1, "data.num_workers": 0, "data.balance_refit": 0,
    "eval.max_samples": 1, "eval.max_new_tokens": 1, "eval.batch_size": 1,
    "parallel.dp": 1, "parallel.dp_replicate": 1, "parallel.dp_shard": 1, "parallel.cp": 1, "parallel.cp_ulysses": 1,
    "parallel.cp_head_groups": 1, "parallel.ep": 1, "parallel.pp_virtual": 1,
    "rl.group_size": 1, "rl.max_new_tokens": 1, "rl.ppo_epochs": 1,
    "rl.mini_batches": 1, "rl.top_k": 0, "rl.rollout.tis_cap": 1, "rl.rollout.max_images": 0,
    "rl.rollout.max_videos": 0, "rl.rollout.max_model_len": 1, "demo.samples": 1, "demo.eval_samples": 0,
}
AUTO = {"parallel.dp", "parallel.dp_shard"}
FRACTIONS = {"train.min_lr_ratio", "train.dpo.label_smoothing", "rl.top_p", "rl.rollout.gpu_memory_utilization"}


def check_ranges(cfg: DictConfig) -> None:
    """Every numeric schema key within its range (:data:`LEAST`, :data:`FRACTIONS`), else a
    :class:`RecipeError` naming the key, its value and the range."""
    for key in (*LEAST, *FRACTIONS):
        value = OmegaConf.select(cfg, key, throw_on_missing=False, default=None)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # unset (required keys are checked where they are needed), or null
        if key in FRACTIONS:
            if not 0 <= value <= 1:
                raise RecipeError(f"{key}={value}: must be between 0 and 1")
        elif value < LEAST[key] and not (key in AUTO and value == -1):
            raise RecipeError(f"{key}={value}: must be >= {LEAST[key]}" + (" (or -1: all that is left)" if key in AUTO else ""))


_COMPONENT_KEY = re.compile(r"^(model\.(\w+)\.(\w+))=")  # model.<section>.<field>=; sections: registry.MODEL_SECTIONS
_LORA_KEY = re.compile(r"^model\.(\w+)\.lora\.(\w+)=")  # model.<section>.lora.<field>= (models/lora.py)


def _component_fields(kind: str, section: Any) -> list[str]:
    """Every field of the registered config class a component section names ([] if none)."""
    import dataclasses

    from omniweave.models import registry

    if kind not in registry.MODEL_SECTIONS or not isinstance(section, dict) or section.get("name") not in registry.names(kind):
        return []
    config_cls = registry.lookup(kind, section["name"])[1]
    return [f.name for f in dataclasses.fields(config_cls)] if config_cls is not None else []


def _compose_with_component_fields(path: Path, overrides: list[str]) -> DictConfig:
    """Compose; when Hydra refuses an override ``model.<component>.<field>=V`` because the
    component's YAML leaves ``field`` at its default, compose again with ``+model.…`` for it, so
    every field of a registered component's config is set the same way; likewise for
    ``model.<component>.lora.<field>=V`` (the LoRA section, models/lora.py, whether the recipe has
    one or not). The second compose (and importing the registry) happens only for such an
    override, not on every load."""
    try:
        return _compose(path, overrides)
    except Exception:  # noqa: BLE001 - Hydra raises many types; load_recipe explains what stays wrong
        fixed = _component_field_overrides(path, overrides)
        if fixed == overrides:
            raise
        return _compose(path, fixed)


def _component_field_overrides(path: Path, overrides: list[str]) -> list[str]:
    """``overrides`` with ``+`` added to each ``model.<component>.<field>=V`` whose field is not in
    the composed YAML but is a field of the component's registered config or a key every component
    takes (registry.COMMON_KEYS: ``lora``, ``lr``, ``lr_scale``, ``weight_decay``, …), and to each
    ``model.<component>.lora.<field>=V`` of a component whose YAML lacks that LoRA field (an
    unknown LoRA field is a RecipeError listing the valid ones)."""
    from omniweave.models.lora import LORA_KEYS
    from omniweave.models.registry import COMMON_KEYS

    fields = {i: m for i, o in enumerate(overrides) if (m := _COMPONENT_KEY.match(o))}
    lora = {i: m for i, o in enumerate(overrides) if (m := _LORA_KEY.match(o))}
    for m in lora.values():
        if m.group(2) not in LORA_KEYS:
            raise RecipeError(f"model.{m.group(1)}.lora.{m.group(2)}: unknown LoRA field; "
                              f"valid: {', '.join(LORA_KEYS)}")
    others = [o for i, o in enumerate(overrides) if i not in fields and i not in lora]
    try:
        model = OmegaConf.to_container(_compose(path, others).model)
    except Exception:  # noqa: BLE001 - the recipe itself is broken: load_recipe explains it
        return overrides
    out = list(overrides)
    for i, m in fields.items():
        kind, key = m.group(2), m.group(3)
        section = model.get(kind)
        settable = key in COMMON_KEYS or key in _component_fields(kind, section)
        if isinstance(section, dict) and key not in section and settable:
            out[i] = "+" + overrides[i]
    for i, m in lora.items():
        section = model.get(m.group(1))
        if isinstance(section, dict) and m.group(2) not in (section.get("lora") or {}):
            out[i] = "+" + overrides[i]
    return out


def unset_key_message(key: str) -> str:
    return f"{key} is not set; pass {key}=VALUE (docs/training.md lists every recipe key)"


def require(cfg: DictConfig, *keys: str) -> None:
    """One clear line for a required key the recipe left unset (``???``)."""
    from omegaconf.errors import MissingMandatoryValue

    for key in keys:
        try:
            OmegaConf.select(cfg, key, throw_on_missing=True)
        except MissingMandatoryValue:
            raise RecipeError(unset_key_message(key)) from None


def _all_keys(path: Path) -> list[str]:
    """Valid dotted keys for suggestions: the schema's plus the recipe's model section."""
    keys = list(schema_defaults())
    try:
        model = OmegaConf.to_container(_compose(path, []).model)
    except Exception:  # noqa: BLE001 - the recipe itself is broken: schema keys only
        return keys
    keys += [f"model.{k}" for k in _flatten(model)]
    for kind, section in model.items():  # fields the component's YAML leaves at their defaults
        keys += [f"model.{kind}.{name}" for name in _component_fields(kind, section)]
    return keys


def _explain(e: Exception, path: Path) -> str:
    """Hydra's multi-line errors (and their causes) as one line a user can act on."""
    text = " ".join(str(x) for x in (e, e.__cause__) if x)
    key = re.search(r"full_key: ([\w.\[\]]+)", text)
    key = key.group(1) if key else None
    if m := re.search(r"Could not override '([^']+)'", text):
        wanted = m.group(1)
        close = difflib.get_close_matches(wanted, _all_keys(path), n=1, cutoff=0.6)
        return f"unknown recipe key {wanted!r}" + (f"; did you mean {close[0]!r}?" if close else
                                                   "; docs/training.md lists every recipe key")
    if m := re.search(r"An item is already at '([^']+)'", text):
        return f"{m.group(1)} is in every recipe already: drop the '+' ({m.group(1)}=VALUE)"
    if "not in" in text and key:  # a key in the recipe file the schema does not know
        close = difflib.get_close_matches(key, _all_keys(path), n=1, cutoff=0.6)
        return f"{path}: unknown recipe key {key!r}" + (f"; did you mean {close[0]!r}?" if close else "")
    if m := re.search(r"Value '([^']*)' (?:of type '\w+' )?could not be converted to (\w+)", text):
        return f"{key or 'a recipe key'}: {m.group(1)!r} is not a valid {m.group(2).lower()}"
    if m := re.search(r"Could not find '([^']+)'", text):
        options = re.search(r"Available options[^:]*:(.*?)(?:Config search path|$)", text, re.S)
        listed = ", ".join(options.group(1).split()) if options else ""
        return f"no component config {m.group(1)!r}" + (f"; available: {listed}" if listed else "")
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{path.name}: {first}"


def to_dict(cfg: DictConfig | dict[str, Any] | None) -> dict[str, Any]:
    if cfg is None:
        return {}
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return dict(cfg)


_SECTIONS = {"train": TrainSchema, "parallel": ParallelSchema, "rl": RLSchema, "eval": EvalSchema, "data": DataSchema}


def section(cfg, name: str):
    """The recipe's ``name`` section as its schema dataclass (``train``: :class:`TrainSchema`, …):
    every key typed and present, every default the schema's own, so the code reads
    ``section(cfg, "train").warmup`` and never states a default twice. A recipe composed by
    :func:`load_recipe` already holds every key; a hand-made config (tests, a checkpoint's
    config.yaml of an older version) gets the schema's defaults for what it lacks. Run-time keys
    the schema does not know are left out."""
    schema = _SECTIONS[name]
    values = to_dict((cfg.get(name) if cfg is not None else None) or {})
    known = {f.name for f in fields(schema)}
    # a typed (structured) config, not to_object: a required key the section lacks (train.steps in a
    # config made for one function) is an error only where it is read
    return OmegaConf.merge(OmegaConf.structured(schema), {k: v for k, v in values.items() if k in known})
