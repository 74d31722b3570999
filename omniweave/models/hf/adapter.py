"""Base of the per-family Hugging Face adapters for decoder-only models.

An adapter maps a HF ``config.json`` dict to our foundation config (and back) and tensor names
in both directions. Our decoder's parameter names are the HF ones without the ``model.`` prefix
(``lm_head.weight`` is the same on both sides). Families register themselves in the one
registry under kind ``hf`` with their HF ``model_type``.

Optional hooks, for a family whose tensors are not one-to-one renames (MoE experts: one HF tensor
per expert, one 3-D tensor of ours), read by loading.py / export.py only where an adapter has them:
``model_tensors_to_ours(tensors)`` (whole-model load), ``assemble(name, has, read)`` (sharded load),
``model_tensors_to_hf(name, t) -> [(hf_name, tensor), ...]`` (export), ``tensors_to_hf(tensors)`` (export:
a pass over the whole HF dict after the per-tensor renames, for tensors HF fuses, e.g. Qwen3-Next).
"""

from __future__ import annotations

from typing import Any

# HF config keys we map explicitly; everything else a family lists in EXTRA_KEYS is carried in
# DecoderConfig.extra_hf so that export writes it back unchanged.
_CARRIED = ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype")


def renamed(name: str, prefixes) -> str | None:
    """``name`` with its prefix replaced by the first ``(prefix, replacement)`` of ``prefixes`` it
    starts with; None when none does."""
    for prefix, replacement in prefixes:
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    return None


class MultimodalAdapter:
    """The whole-model interface of loading.py / export.py for an adapter of a model with encoders
    (Qwen2-VL, Qwen2-Audio, Qwen2.5-Omni): names through its ``name_to_ours`` / ``name_to_hf``,
    configs through ``model_config_to_ours`` / ``_config_to_hf(foundation, *component configs)``,
    the components named by ``config_sections`` (the OmniModel attributes, in that order)."""

    config_sections: tuple[str, ...] = ()

    def model_config(self, hf: dict[str, Any]) -> dict[str, Any]:
        return self.model_config_to_ours(hf)

    def model_name_to_ours(self, hf_name: str) -> str | None:
        return self.name_to_ours(hf_name)

    def model_name_to_hf(self, name: str) -> str | None:
        return self.name_to_hf(name)

    def model_config_to_hf(self, model, *rest) -> dict[str, Any]:
        """From an OmniModel, or from (foundation, *config_sections) configs."""
        if rest:
            return self._config_to_hf(model, *rest)
        parts = [getattr(model, s, None) for s in self.config_sections]
        if any(p is None for p in parts):
            raise ValueError(f"a {self.model_type} export needs {', '.join(self.config_sections)}")
        return self._config_to_hf(model.foundation.config, *(p.cfg for p in parts))


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict | None, list[int] | None]:
    """(theta, scaling, mrope_section) from a transformers 4.x (rope_theta/rope_scaling) or 5.x
    (rope_parameters) config."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = dict(hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    merged = {**legacy, **params}
    merged.pop("rope_theta", None)
    mrope = merged.pop("mrope_section", None)
    merged.pop("mrope_interleaved", None)
    merged.pop("partial_rotary_factor", None)  # a decoder field of its own (the hybrid families' adapters read it)
    if "type" in merged:  # the 4.x name (DeepSeek-V3's released config: rope_scaling.type = yarn)
        merged.setdefault("rope_type", merged.pop("type"))
    kind = merged.get("rope_type", "default")
    scaling = None if kind == "default" else merged
    return theta, scaling, (list(mrope) if mrope else None)


def rope_to_hf(cfg) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling:
        params.update(cfg.rope_scaling)
    out: dict[str, Any] = {"rope_parameters": params, "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    return out


class DecoderAdapter:
    model_type = ""  # HF model_type
    architecture = ""  # HF architectures[0]
    family = ""  # DecoderConfig.family

    # ---- config -------------------------------------------------------------------------
    def config_to_ours(self, hf: dict[str, Any]) -> dict[str, Any]:
        """A foundation component dict (``name: decoder`` + DecoderConfig fields)."""
        theta, scaling, mrope = rope_from_hf(hf)
        heads = hf["num_attention_heads"]
        cfg = {
            "name": "decoder",
            "family": self.family,
            "vocab_size": hf["vocab_size"],
            "hidden_size": hf["hidden_size"],
            "intermediate_size": hf["intermediate_size"],
            "num_layers": hf["num_hidden_layers"],
            "num_heads": heads,
            "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
            "rope_theta": theta,
            "rope_scaling": scaling,
            "mrope_section": mrope,
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
            "max_position_embeddings": hf.get("max_position_embeddings", 32768),
            "hidden_act": hf.get("hidden_act", "silu"),
            "initializer_range": hf.get("initializer_range", 0.02),
            "extra_hf": {k: hf[k] for k in _CARRIED if k in hf},
        }
        if hf.get("use_sliding_window") and hf.get("sliding_window"):
            raise NotImplementedError(f"{self.model_type}: per-layer sliding window (use_sliding_window) is not supported")
        cfg.update(self.family_config_to_ours(hf))
        return cfg

    def family_config_to_ours(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {}

    def config_to_hf(self, cfg) -> dict[str, Any]:
        """HF config.json dict of a DecoderConfig."""
        if cfg.family != self.family:  # e.g. a Qwen2.5-VL recipe with the DeepSeek-V3 backbone swapped in
            raise ValueError(f"a {self.model_type} export needs a foundation of family {self.family}; this one is "
                             f"{cfg.family} (transformers has no such combination to load it)")  # fmt: skip
        out = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": cfg.hidden_act,
            "rms_norm_eps": cfg.rms_norm_eps,
            "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "initializer_range": cfg.initializer_range,
            **rope_to_hf(cfg),
            **cfg.extra_hf,
        }
        out.update(self.family_config_to_hf(cfg))
        return out

    def family_config_to_hf(self, cfg) -> dict[str, Any]:
        return {}

    # ---- tensor names -------------------------------------------------------------------
    def name_to_ours(self, hf_name: str) -> str | None:
        """Our parameter name of a HF tensor; None for tensors we do not keep (rotary buffers)."""
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        if hf_name.startswith("model."):
            return hf_name[len("model.") :]
        if hf_name == "lm_head.weight":
            return hf_name
        raise KeyError(f"{self.model_type}: unexpected tensor {hf_name!r} in the checkpoint")

    def name_to_hf(self, name: str) -> str:
        return name if name == "lm_head.weight" else f"model.{name}"

    # ---- whole-model view (CausalLM: the decoder lives under ``foundation.``) ---------------
    def model_config(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The recipe ``model:`` section of a HF config."""
        return {"foundation": self.config_to_ours(hf)}

    def model_name_to_ours(self, hf_name: str) -> str | None:
        name = self.name_to_ours(hf_name)
        return None if name is None else f"foundation.{name}"

    def model_name_to_hf(self, name: str) -> str | None:
        """HF name of one of our model's tensors; None for tensors HF does not store (tied head)."""
        if not name.startswith("foundation."):
            raise KeyError(f"{self.model_type}: no HF name for {name!r}")
        return self.name_to_hf(name[len("foundation.") :])

    def model_config_to_hf(self, model) -> dict[str, Any]:
        return self.config_to_hf(model.foundation.config)

    def skip_on_export(self, model) -> set[str]:
        return {"foundation.lm_head.weight"} if model.foundation.config.tie_word_embeddings else set()
