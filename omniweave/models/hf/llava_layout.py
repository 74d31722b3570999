"""What the HF adapters of Llava-layout families share (InternVL, LLaVA-OneVision): a vision tower,
a ``multi_modal_projector`` and any registered text family under ``language_model``.

    transformers' save_pretrained (checkpoint)   in memory                       ours
    language_model.model.*                        model.language_model.*          foundation.*
    language_model.lm_head.weight                 lm_head.weight                  foundation.lm_head.weight
    vision_tower.*                                model.vision_tower.*            image_encoder.* (the family's names)
    multi_modal_projector.*                       model.multi_modal_projector.*   projector.*

Both layouts load; exports write the checkpoint one. The family adapter maps its tower's names
(``vision_to_ours`` / ``vision_to_hf``, in-memory names) and names the HF q / k / v projections of
a block (``qkv_names``), which are one fused ``attn.qkv`` here: fused on load (whole-model and
sharded), split on export. A MoE decoder's experts go through hf/experts.py's per-expert layout.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import torch

from omniweave.models.hf.adapter import MultimodalAdapter, renamed
from omniweave.models.hf.experts import PerExpertTensors
from omniweave.models.hf.loading import adapter_for

SAVED = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
         ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))  # fmt: skip
_OUR_QKV = re.compile(r"^image_encoder\.blocks\.(\d+)\.attn\.qkv\.(weight|bias)$")
_PART = re.compile(r"^(image_encoder\.blocks\.\d+\.attn\.qkv\.(?:weight|bias))\.([qkv])$")


class LlavaLayoutAdapter(PerExpertTensors, MultimodalAdapter):
    config_sections = ("image_encoder", "projector")
    multimodal = True
    saved: tuple[tuple[str, str], ...] = SAVED  # a family may add its own top-level tensors (image_newline)

    # ---- what a family defines --------------------------------------------------------
    def vision_to_ours(self, name: str) -> str | None:
        """Our name of an in-memory HF tensor under ``model.vision_tower.`` / ``model.multi_modal_projector.``
        (None: not kept); q / k / v projections are handled by ``qkv_names``."""
        raise NotImplementedError

    def vision_to_hf(self, name: str) -> str:
        """The in-memory HF name of one of our ``image_encoder.`` / ``projector.`` tensors (not a fused qkv)."""
        raise NotImplementedError

    def qkv_names(self, layer: str, leaf: str) -> list[str]:
        """In-memory HF names of block ``layer``'s q, k, v projections (``leaf``: weight / bias)."""
        raise NotImplementedError

    # ---- config ---------------------------------------------------------------------
    def text_foundation(self, hf: dict[str, Any], vl_keys: tuple[str, ...]) -> dict[str, Any]:
        """The foundation section from ``text_config`` by its own family's adapter (1-D RoPE), the
        tie flag of the whole config, and ``vl_keys`` carried in ``extra_hf["vl"]`` for export."""
        text = dict(hf.get("text_config") or {})
        text.setdefault("model_type", "qwen2")
        text["tie_word_embeddings"] = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        foundation = adapter_for(text["model_type"]).config_to_ours(text)
        if foundation.get("mrope_section"):
            raise ValueError(f"{self.model_type}: the text config has an M-RoPE mrope_section; its decoder uses 1-D RoPE")
        foundation["extra_hf"] = {**foundation.get("extra_hf", {}), "vl": {k: hf[k] for k in vl_keys if k in hf}}
        return foundation

    def text_config_to_hf(self, foundation) -> tuple[dict[str, Any], dict[str, Any]]:
        """(text_config of the foundation by its family's adapter, the carried ``vl`` keys)."""
        extra = dict(foundation.extra_hf)
        vl = extra.pop("vl", {})
        text = adapter_for(foundation.family).config_to_hf(dataclasses.replace(foundation, extra_hf=extra))
        text.pop("architectures", None)
        return text, vl

    # ---- tensor names ---------------------------------------------------------------
    def _in_memory(self, hf_name: str) -> str:
        return renamed(hf_name, self.saved) or hf_name

    def _saved(self, hf_name: str) -> str:
        return renamed(hf_name, [(b, a) for a, b in self.saved]) or hf_name

    def _qkv_part(self, hf_name: str) -> str | None:
        """``image_encoder.blocks.N.attn.qkv.<leaf>.<q|k|v>`` for an in-memory q / k / v name."""
        m = re.match(r"^model\.vision_tower\..*?(\d+)\..*?([qkv])_proj\.(weight|bias)$", hf_name)
        if m and hf_name in self.qkv_names(m[1], m[3]):
            return f"image_encoder.blocks.{m[1]}.attn.qkv.{m[3]}.{m[2]}"
        return None

    def name_to_ours(self, hf_name: str) -> str | None:
        hf_name = self._in_memory(hf_name)
        if hf_name == "lm_head.weight":
            return "foundation.lm_head.weight"
        if hf_name.startswith("model.language_model."):
            return "foundation." + hf_name[len("model.language_model."):]
        if self._qkv_part(hf_name):
            return None  # fused by model_tensors_to_ours / assemble
        return self.vision_to_ours(hf_name)

    def name_to_hf(self, name: str) -> str:
        """Our name -> the name transformers' ``save_pretrained`` writes (checkpoint layout)."""
        if name == "foundation.lm_head.weight":
            return self._saved("lm_head.weight")
        if name.startswith("foundation."):
            return self._saved("model.language_model." + name[len("foundation."):])
        return self._saved(self.vision_to_hf(name))

    def model_name_to_ours(self, hf_name: str) -> str | None:
        return self._qkv_part(self._in_memory(hf_name)) or self.name_to_ours(hf_name)

    def model_tensors_to_ours(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """q / k / v of each block (loaded under their fused name's parts) concatenated; a MoE
        decoder's per-expert tensors stacked."""
        out, parts = {}, {}
        for name, t in tensors.items():
            m = _PART.match(name)
            if m:
                parts.setdefault(m[1], {})[m[2]] = t
            else:
                out[name] = t
        for name, qkv in parts.items():
            if set(qkv) != {"q", "k", "v"}:
                raise KeyError(f"{self.model_type}: {name} needs q, k and v projections, the checkpoint has {sorted(qkv)}")
            out[name] = torch.cat([qkv["q"], qkv["k"], qkv["v"]])
        return super().model_tensors_to_ours(out)

    def model_tensors_to_hf(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        m = _OUR_QKV.match(name)
        if m:
            return [(self._saved(n), part.contiguous()) for n, part in zip(self.qkv_names(m[1], m[2]), t.chunk(3))]
        return super().model_tensors_to_hf(name, t)  # experts one tensor each, the rest renamed

    def assemble(self, name: str, has: Callable[[str], bool], read: Callable[[str], torch.Tensor]) -> torch.Tensor | None:
        """A fused ``attn.qkv`` read from its three HF tensors (``load_hf_into``); a MoE decoder's
        experts; None otherwise."""
        m = _OUR_QKV.match(name)
        if not m:
            return super().assemble(name, has, read)
        names = [n if has(n) else self._saved(n) for n in self.qkv_names(m[1], m[2])]
        missing = [n for n in names if not has(n)]
        if missing:
            raise KeyError(f"{self.model_type}: missing tensor(s) {missing}")
        return torch.cat([read(n) for n in names])

    def skip_on_export(self, model) -> set[str]:
        return {"foundation.lm_head.weight"} if model.foundation.config.tie_word_embeddings else set()


def side(v) -> int:
    """One side of a square ``image_size`` / ``patch_size`` (an int or [h, w])."""
    if isinstance(v, (list, tuple)):
        if len(set(v)) != 1:
            raise ValueError(f"non-square vision sizes {v} are not supported")
        return int(v[0])
    return int(v)
