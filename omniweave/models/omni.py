"""OmniModel = image encoder + projector + foundation decoder, on one packed row.

    embeds   = foundation.embed(input_ids)                          [L, D]
    hidden   = image_encoder(pixel_values, grid_thw)                [P, D_vis]  all media at once
    features = projector(hidden, grid_thw)                          [N, D]      N = Σ span lengths
    embeds[span_0] , embeds[span_1] , … = features (in span order)
    loss_sum = chunked_ce(foundation(embeds, position_ids, cu_seqlens), labels)

One encoder call covers every image and video of the micro-batch (varlen attention inside the
encoder keeps them apart), so the encoder sees one large batch instead of many small ones.
``media_spans [S, 2]`` (start, length) say where the features go: the spans take the items'
features in order (``pixel_values`` and ``grid_thw`` are in span order), one span per item, or
several consecutive spans per item where the tokenizer writes text inside an item (Qwen3-VL:
a timestamp before each temporal patch of a video). Spans that do not add up to the items'
feature counts, or cross from one item into the next, are a data bug and raise with the numbers.

No-media micro-batches (``run_encoder_always``, default on): a row without any media still runs
the encoder and projector on a tiny dummy item (one merge block of zero pixels) and adds
``0 × sum(features)`` to the embeddings. The result is unchanged, the encoder's gradients exist
and are zero, and — what matters under FSDP — every rank runs the same encoder forward/backward,
so the all-gathers / reduce-scatters of the encoder's shards stay matched even when only some
ranks have media. Turn it off only for single-process inference.

Two hook points let ``parallel/`` change how the row is computed without the model knowing:
``media_split`` (``media_split(encode, pixel_values, grid_thw) -> features [N, D]``: e.g. each
context-parallel rank encodes a share of the media and the features are all-gathered), and the
optional batch key ``feature_rows [L]`` (int64: for each row, the index of the media feature it
takes, -1 for text), which replaces ``media_spans`` when the row is a shard of a longer one.

DeepStack (Qwen3-VL): a projector with ``deepstack_levels = K`` returns ``[N, D·(1+K)]``; the
first D columns go into the embeddings, the K levels reach the foundation as its ``deepstack``
input, placed by the same rows (components/deepstack.py). The hooks above see one tensor and
need no change; the no-media dummy pass covers the DeepStack mergers too.
"""

from __future__ import annotations

import torch
from torch import nn

from omniweave.models.components.deepstack import DeepStack, split_levels
from omniweave.models.text import LMHeadMixin, _cu_seqlens, _positions


def feature_rows_from_spans(media_spans: torch.Tensor, row_len: int) -> torch.Tensor:
    """int64 [L] on the spans' device: for each row inside media span i (start, length) at offset
    o, Σ_{j<i} len_j + o (its media feature in span order); -1 elsewhere. Shared by the model (spans ->
    rows), CP sharding and the TP sequence-parallel hand-off."""
    spans = media_spans.to(torch.long).reshape(-1, 2)
    rows = torch.full((row_len,), -1, dtype=torch.int64, device=spans.device)
    first_feature = 0
    for start, length in spans.tolist():
        if start < 0 or length < 0 or start + length > row_len:
            raise ValueError(f"media span (start {start}, length {length}) falls outside the row of {row_len} tokens")
        rows[start:start + length] = torch.arange(first_feature, first_feature + length, device=spans.device)
        first_feature += length
    return rows


class OmniModel(LMHeadMixin, nn.Module):
    def __init__(
        self,
        foundation: nn.Module,
        image_encoder: nn.Module | None = None,
        projector: nn.Module | None = None,
        run_encoder_always: bool = True,
        loss_chunk: int = 1024,
    ):
        super().__init__()
        if (image_encoder is None) != (projector is None):
            raise ValueError("OmniModel needs both an image_encoder and a projector, or neither")
        self.foundation = foundation
        self.image_encoder = image_encoder
        self.projector = projector
        self.run_encoder_always = run_encoder_always
        self.loss_chunk = loss_chunk
        self.media_split = None  # set by parallel/context for the vision split; see the module doc
        if image_encoder is not None and self.deepstack_levels != getattr(image_encoder, "deepstack_levels", 0):
            raise ValueError(f"image_encoder gives {getattr(image_encoder, 'deepstack_levels', 0)} DeepStack levels "
                             f"(deepstack_visual_indexes), projector merges {self.deepstack_levels} "
                             "(projector deepstack_levels): they must agree")  # fmt: skip

    @property
    def deepstack_levels(self) -> int:
        """DeepStack levels the projector returns beside the features (0: none)."""
        return getattr(self.projector, "deepstack_levels", 0)

    def init_weights(self) -> None:
        """Re-initialise every component (e.g. after ``to_empty`` from the meta device)."""
        for part in (self.foundation, self.image_encoder, self.projector):
            if part is not None and hasattr(part, "init_weights"):
                part.init_weights()

    def hf_model_type(self) -> str:
        """HF family for ``omniweave hf export``: the encoder decides (qwen2_vl / qwen2_5_vl), or,
        where one tower serves several families, its ``hf_model_type(foundation_config)`` does
        (qwen3_vl / qwen3_vl_moe)."""
        kind = self.image_encoder.hf_model_type
        return kind(self.foundation.config) if callable(kind) else kind

    # ------------------------------------------------------------------ media

    def encode_media(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """All media of a row -> projected features [N, D] in span order."""
        if self.media_split is not None:
            return self.media_split(self._encode, pixel_values, grid_thw)
        return self._encode(pixel_values, grid_thw)

    def _encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.projector(self.image_encoder(pixel_values, grid_thw), grid_thw)

    def _dummy_features(self, device) -> torch.Tensor:
        pixel_values, grid_thw = self.image_encoder.dummy_input(device)
        return self.encode_media(pixel_values, grid_thw)

    def inputs_embeds(self, batch: dict) -> torch.Tensor:
        """Token embeddings [L, D] with media features scattered into their placeholder spans."""
        return self.foundation_inputs(batch)["inputs_embeds"]

    def foundation_inputs(self, batch: dict) -> dict:
        """The foundation's media-dependent inputs: ``inputs_embeds`` [L, D] and, for an encoder
        with DeepStack levels (components/deepstack.py), ``deepstack``.

        This is the point where a context-parallel split of the sequence may happen."""
        ids = batch["input_ids"]
        embeds = self.foundation.embed(ids)
        grid_thw = batch.get("grid_thw")
        has_media = grid_thw is not None and grid_thw.shape[0] > 0
        if self.image_encoder is None:
            if has_media:
                raise ValueError("batch has media (grid_thw) but the model has no image_encoder")
            return {"inputs_embeds": embeds}
        if not has_media:
            if self.run_encoder_always:  # keep FSDP collectives matched; contributes exactly 0
                embeds = embeds + 0.0 * self._dummy_features(embeds.device).sum().to(embeds.dtype)
            return {"inputs_embeds": embeds}
        rows, spans = batch.get("feature_rows"), None
        if rows is None:
            spans = self.check_media_spans(batch.get("media_spans"), grid_thw, ids.shape[0])
            rows = feature_rows_from_spans(spans, ids.shape[0])
        features = self.encode_media(batch["pixel_values"], grid_thw)  # [N, D·(1+K)]
        levels = self.deepstack_levels
        if levels:
            features, stacked = split_levels(features, levels)
        if spans is not None and features.shape[0] != int(spans[:, 1].sum()):
            raise ValueError(f"projector produced {features.shape[0]} features, spans need {int(spans[:, 1].sum())}")
        out = {"inputs_embeds": self._scatter_rows(embeds, rows, features)}
        if levels:
            out["deepstack"] = DeepStack(rows.to(device=embeds.device, dtype=torch.long), stacked)
        return out

    def check_media_spans(self, spans: torch.Tensor | None, grid_thw: torch.Tensor, length: int) -> torch.Tensor:
        """media_spans [S, 2] (int64) after checking them against the media: the spans take the
        items' features in order, each item's features filling one span or several consecutive
        ones (S >= M: a Qwen3-VL video has one span per temporal patch, timestamps between), no span
        crossing from one item into the next, all inside the row of ``length`` tokens."""
        if spans is None:
            raise ValueError("batch has grid_thw but no media_spans to place the features")
        spans = spans.to(torch.long).reshape(-1, 2)
        expected = self.projector.num_tokens(grid_thw).to(spans.device)
        item_ends, span_ends = set(expected.cumsum(0).tolist()), set(spans[:, 1].cumsum(0).tolist())
        if spans.shape[0] < grid_thw.shape[0] or int(spans[:, 1].sum()) != int(expected.sum()) or not item_ends <= span_ends:
            raise ValueError(
                f"media features do not match placeholder spans: grid_thw {grid_thw.tolist()} gives "
                f"{expected.tolist()} feature tokens per item, media_spans lengths are {spans[:, 1].tolist()}"
            )
        if int((spans[:, 0] + spans[:, 1]).max()) > length or int(spans[:, 0].min()) < 0:
            raise ValueError(f"media_spans {spans.tolist()} fall outside the row of {length} tokens")
        return spans

    @staticmethod
    def _scatter_rows(embeds: torch.Tensor, rows: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """embeds [L, D] with row i replaced by features[rows[i]] wherever rows[i] >= 0."""
        rows = rows.to(device=embeds.device, dtype=torch.long)
        top = int(rows.max()) if rows.numel() else -1
        if rows.shape[0] != embeds.shape[0] or top >= features.shape[0]:
            raise ValueError(f"feature_rows (length {rows.shape[0]}, max {top}) do not fit "
                             f"{embeds.shape[0]} rows and {features.shape[0]} media features")
        taken = features.to(embeds.dtype)[rows.clamp_min(0)]
        return torch.where((rows >= 0)[:, None], taken, embeds)

    # ------------------------------------------------------------------ the model contract

    def hidden(self, batch: dict) -> torch.Tensor:
        inputs = self.foundation_inputs(batch)
        L, device = inputs["inputs_embeds"].shape[0], inputs["inputs_embeds"].device
        return self.foundation(**inputs, position_ids=_positions(batch, L, device), cu_seqlens=_cu_seqlens(batch, L, device),
                               token_valid=batch.get("token_valid"))
