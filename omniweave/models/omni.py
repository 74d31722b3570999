"""OmniModel = image encoder + projector + foundation decoder, on one packed row.

    embeds   = foundation.embed(input_ids)                          [L, D]
    hidden   = image_encoder(pixel_values, grid_thw)                [P, D_vis]  all media at once
    features = projector(hidden, grid_thw)                          [N, D]      N = Σ span lengths
    embeds[span_0] , embeds[span_1] , … = features (in span order)
    loss_sum = chunked_ce(foundation(embeds, position_ids, cu_seqlens), labels)

One encoder call covers every image and video of the micro-batch (varlen attention inside the
encoder keeps them apart), so the encoder sees one large batch instead of many small ones.
``media_spans [M, 2]`` (start, length) say where each item's features go; the i-th span takes
the i-th item's features (``pixel_values`` and ``grid_thw`` are in span order). A span whose
length differs from the item's feature count is a data bug and raises with the numbers.

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
"""

from __future__ import annotations

import torch
from torch import nn

from omniweave.models.text import LMHeadMixin, _cu_seqlens, _positions


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

    def init_weights(self) -> None:
        """Re-initialise every component (e.g. after ``to_empty`` from the meta device)."""
        for part in (self.foundation, self.image_encoder, self.projector):
            if part is not None and hasattr(part, "init_weights"):
                part.init_weights()

    def hf_model_type(self) -> str:
        """HF family for ``omniweave hf export`` (the encoder decides: qwen2_vl / qwen2_5_vl)."""
        return self.image_encoder.hf_model_type

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
        """Token embeddings [L, D] with media features scattered into their placeholder spans.

        This is the point where a context-parallel split of the sequence may happen."""
        ids = batch["input_ids"]
        embeds = self.foundation.embed(ids)
        grid_thw = batch.get("grid_thw")
        has_media = grid_thw is not None and grid_thw.shape[0] > 0
        if self.image_encoder is None:
            if has_media:
                raise ValueError("batch has media (grid_thw) but the model has no image_encoder")
            return embeds
        if not has_media:
            if self.run_encoder_always:  # keep FSDP collectives matched; contributes exactly 0
                embeds = embeds + 0.0 * self._dummy_features(embeds.device).sum().to(embeds.dtype)
            return embeds
        if batch.get("feature_rows") is not None:
            return self._scatter_rows(embeds, batch["feature_rows"], self.encode_media(batch["pixel_values"], grid_thw))
        spans = self.check_media_spans(batch.get("media_spans"), grid_thw, ids.shape[0])
        features = self.encode_media(batch["pixel_values"], grid_thw)  # [N, D]
        if features.shape[0] != int(spans[:, 1].sum()):
            raise ValueError(f"projector produced {features.shape[0]} features, spans need {int(spans[:, 1].sum())}")
        index = torch.cat([torch.arange(s, s + n, device=ids.device) for s, n in spans.tolist()])
        return embeds.index_put((index,), features.to(embeds.dtype))  # out of place: autograd-safe

    def check_media_spans(self, spans: torch.Tensor | None, grid_thw: torch.Tensor, length: int) -> torch.Tensor:
        """media_spans [M, 2] (int64) after checking them against the media: one span per item, each
        as long as the item's feature count, all inside the row of ``length`` tokens."""
        if spans is None:
            raise ValueError("batch has grid_thw but no media_spans to place the features")
        spans = spans.to(torch.long).reshape(-1, 2)
        expected = self.projector.num_tokens(grid_thw).to(spans.device)
        if spans.shape[0] != grid_thw.shape[0] or not torch.equal(spans[:, 1], expected):
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
        embeds = self.inputs_embeds(batch)
        L, device = embeds.shape[0], embeds.device
        return self.foundation(
            inputs_embeds=embeds,
            position_ids=_positions(batch, L, device),
            cu_seqlens=_cu_seqlens(batch, L, device),
            token_valid=batch.get("token_valid"),
        )
