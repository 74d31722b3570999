"""OmniModel = encoders + projectors (one pair per modality) + foundation decoder, on one packed row.

    embeds   = foundation.embed(input_ids)                                  [L, D]
    for each modality the model has (registry.MODALITIES: vision, audio):
        hidden   = encoder(inputs, grid)      e.g. ViT(pixel_values, grid_thw), audio tower(audio_features, audio_lengths)
        features = projector(hidden, grid)                                  [N, D]   N = Σ span lengths
        embeds[span_0] , embeds[span_1] , … = features (in span order)
    loss_sum = chunked_ce(foundation(embeds, position_ids, cu_seqlens), labels)

The model's encoders are its sections of ``registry.MODALITIES`` (``image_encoder`` +
``projector``, ``audio_encoder`` + ``audio_projector``), wired from YAML; each modality's items ride
in its own batch keys (``pixel_values / grid_thw / media_spans / feature_rows``, ``audio_features /
audio_lengths / audio_spans / audio_feature_rows``) and nothing here names a modality.

One encoder call covers every item of a modality in the micro-batch (varlen attention inside the
encoder keeps them apart), so the encoder sees one large batch instead of many small ones. The
spans ``[S, 2]`` (start, length) say where the features go: the spans take the items' features in
order, one span per item, or several consecutive spans per item where the tokenizer writes text
inside an item (Qwen3-VL: a timestamp before each temporal patch of a video). Spans that do not
add up to the items' feature counts, or cross from one item into the next, are a data bug and
raise with the numbers.

Micro-batches without a modality's items (``run_encoder_always``, default on): the encoder and
projector still run on a tiny dummy item (``encoder.dummy_input``) and ``0 × sum(features)`` is
added to the embeddings. The result is unchanged, the encoder's gradients exist and are zero, and
— what matters under FSDP — every rank runs the same encoder forward/backward, so the
all-gathers / reduce-scatters of the encoder's shards stay matched even when only some ranks have
that modality. Turn it off only for single-process inference.

Three hook points let ``parallel/`` change how the row is computed without the model knowing:
``media_splits[modality]`` (``split(encode, inputs, grid) -> features [N, D]``: e.g. each
context-parallel rank encodes a share of the items and the features are all-gathered),
``media_handoffs[modality]`` (``handoff(features) -> features``, after a projector's layout of
whole items: tensor parallelism's hand-off to the sequence-parallel decoder), and the
optional batch key ``rows`` of a modality (``feature_rows [L]``, int64: for each row, the index of
the feature it takes, -1 elsewhere), which replaces the spans when the row is a shard of a longer one.

DeepStack (Qwen3-VL): a projector with ``deepstack_levels = K`` returns ``[N, D·(1+K)]``; the
first D columns go into the embeddings, the K levels reach the foundation as its ``deepstack``
input, placed by the same rows (components/deepstack.py). The hooks above see one tensor and
need no change; the no-media dummy pass covers the DeepStack mergers too.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
from torch import nn

from omniweave.models.components.deepstack import DeepStack, split_levels
from omniweave.models.components.prefix_attention import PrefixLayout
from omniweave.models.registry import ENCODER_SECTIONS, MODALITIES, Modality
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


def cat_items(inputs: list[torch.Tensor]) -> torch.Tensor:
    """One modality's encoder inputs from several rows or prompts, concatenated along the item /
    row dim 0; trailing dims zero-padded to the largest (audio windows of different widths W;
    an encoder reads only each item's valid part)."""
    shape = [max(x.shape[d] for x in inputs) for d in range(1, inputs[0].dim())]
    padded = []
    for x in inputs:
        pad = [p for d in reversed(range(1, x.dim())) for p in (0, shape[d - 1] - x.shape[d])]
        padded.append(torch.nn.functional.pad(x, pad) if any(pad) else x)
    return torch.cat(padded)


class OmniModel(LMHeadMixin, nn.Module):
    def __init__(self, foundation: nn.Module, run_encoder_always: bool = True, loss_chunk: int = 1024,
                 **components: nn.Module | None):
        """``components``: encoders and projectors by their section names (``image_encoder=…,
        projector=…``, ``audio_encoder=…, audio_projector=…``); a modality needs both or neither."""
        super().__init__()
        unknown = sorted(set(components) - set(ENCODER_SECTIONS))
        if unknown:
            raise TypeError(f"OmniModel: unknown component(s) {unknown}; known: {', '.join(ENCODER_SECTIONS)}")
        self.foundation = foundation
        self.modalities: tuple[Modality, ...] = ()  # the modalities this model encodes, in MODALITIES order
        for m in MODALITIES:
            encoder, projector = components.get(m.encoder), components.get(m.projector)
            if (encoder is None) != (projector is None):
                raise ValueError(f"OmniModel needs both an {m.encoder} and a {m.projector}, or neither")
            setattr(self, m.encoder, encoder)
            setattr(self, m.projector, projector)
            if encoder is None:
                continue
            self.modalities += (m,)
            given, merged = getattr(encoder, "deepstack_levels", 0), getattr(projector, "deepstack_levels", 0)
            if given != merged:
                raise ValueError(f"{m.encoder} gives {given} DeepStack levels (deepstack_visual_indexes), "
                                 f"{m.projector} merges {merged} (deepstack_levels): they must agree")  # fmt: skip
        if sum(1 for m in self.modalities if self._levels(m)) > 1:
            raise ValueError("DeepStack levels from more than one modality are not supported")
        self.run_encoder_always = run_encoder_always
        self.loss_chunk = loss_chunk
        self.media_splits: dict = {}  # modality name -> split hook, set by parallel/ (see the module doc)
        self.media_handoffs: dict = {}  # modality name -> features hook after the projector's layout (TP's hand-off)

    def _levels(self, m: Modality) -> int:
        return getattr(getattr(self, m.projector), "deepstack_levels", 0)

    @property
    def deepstack_levels(self) -> int:
        """DeepStack levels a projector returns beside the features (0: none)."""
        return sum(self._levels(m) for m in self.modalities)

    def modality(self, name: str) -> Modality:
        for m in self.modalities:
            if m.name == name:
                return m
        raise ValueError(f"the model has no {name} encoder (it encodes: {[m.name for m in self.modalities]})")

    def init_weights(self) -> None:
        """Re-initialise every component (e.g. after ``to_empty`` from the meta device)."""
        parts = [self.foundation, *(getattr(self, s) for m in self.modalities for s in (m.encoder, m.projector))]
        for part in parts:
            if hasattr(part, "init_weights"):
                part.init_weights()

    def hf_model_type(self) -> str:
        """HF family for ``omniweave hf export``: the encoders decide (qwen2_vl, qwen2_5_vl,
        qwen2_audio…), or, where one tower serves several families, its
        ``hf_model_type(foundation_config)`` does (qwen3_vl / qwen3_vl_moe)."""
        kinds = []
        for m in self.modalities:
            kind = getattr(getattr(self, m.encoder), "hf_model_type", None)
            kind = kind(self.foundation.config) if callable(kind) else kind
            if kind is None:
                raise ValueError(f"{m.encoder} {type(getattr(self, m.encoder)).__name__} has no HF family to export as")
            kinds.append(kind)
        if len(set(kinds)) != 1:
            raise ValueError(f"no single HF family holds these encoders: {dict(zip((m.encoder for m in self.modalities), kinds))}")
        return kinds[0]

    # ------------------------------------------------------------------ media

    def encode_media(self, inputs: torch.Tensor, grid: torch.Tensor, modality: str = "vision",
                     sizes: torch.Tensor | None = None) -> torch.Tensor:
        """All items of one modality in a row -> projected features [N, D] in span order. A
        projector that ``arranges`` lays out each whole item's features after the split hook
        (LLaVA-OneVision: unpadding, newline rows; ``sizes`` the items' own sizes)."""
        m = self.modality(modality)
        encode = partial(self._encode, m)
        split = self.media_splits.get(m.name)
        features = encode(inputs, grid) if split is None else split(encode, inputs, grid)
        projector = getattr(self, m.projector)
        if getattr(projector, "arranges", False):  # through forward: FSDP gathers the projector's weights around it
            features = projector(features, grid, sizes=sizes, arrange=True)
        handoff = self.media_handoffs.get(m.name)
        return features if handoff is None else handoff(features)

    def item_tokens(self, m: Modality, grid: torch.Tensor, sizes: torch.Tensor | None = None) -> torch.Tensor:
        """int64 [M]: the features each item of modality ``m`` gets (its projector's ``num_tokens``)."""
        projector = getattr(self, m.projector)
        if getattr(projector, "uses_sizes", False):
            if sizes is None:
                raise ValueError(f"{m.projector} lays features out by each item's size: the batch needs {m.sizes}")
            return projector.num_tokens(grid, sizes)
        return projector.num_tokens(grid)

    def _encode(self, m: Modality, inputs: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        return getattr(self, m.projector)(getattr(self, m.encoder)(inputs, grid), grid)

    def _dummy_features(self, m: Modality, device) -> torch.Tensor:
        return self.encode_media(*getattr(self, m.encoder).dummy_input(device), modality=m.name)

    def inputs_embeds(self, batch: dict) -> torch.Tensor:
        """Token embeddings [L, D] with media features scattered into their placeholder spans."""
        return self.foundation_inputs(batch)["inputs_embeds"]

    def foundation_inputs(self, batch: dict) -> dict:
        """The foundation's media-dependent inputs: ``inputs_embeds`` [L, D] and, for an encoder
        with DeepStack levels (components/deepstack.py), ``deepstack``.

        This is the point where a context-parallel split of the sequence may happen."""
        ids = batch["input_ids"]
        embeds = self.foundation.embed(ids)
        for m in MODALITIES:
            grid = batch.get(m.grid)
            if m not in self.modalities and grid is not None and grid.shape[0] > 0:
                raise ValueError(f"batch has {m.name} items ({m.grid}) but the model has no {m.encoder}")
        out = {}
        for m in self.modalities:
            grid = batch.get(m.grid)
            if grid is None or grid.shape[0] == 0:
                if self.run_encoder_always:  # keep FSDP collectives matched; contributes exactly 0
                    embeds = embeds + 0.0 * self._dummy_features(m, embeds.device).sum().to(embeds.dtype)
                continue
            rows, spans, sizes = batch.get(m.rows), None, batch.get(m.sizes) if m.sizes else None
            if rows is None:
                spans = self.check_media_spans(batch.get(m.spans), grid, ids.shape[0], m.name, sizes)
                rows = feature_rows_from_spans(spans, ids.shape[0])
            features = self.encode_media(batch[m.inputs], grid, m.name, sizes)  # [N, D·(1+K)]
            levels = self._levels(m)
            if levels:
                features, stacked = split_levels(features, levels)
                out["deepstack"] = DeepStack(rows.to(device=embeds.device, dtype=torch.long), stacked)
            if spans is not None and features.shape[0] != int(spans[:, 1].sum()):
                raise ValueError(f"{m.projector} produced {features.shape[0]} features, spans need {int(spans[:, 1].sum())}")
            embeds = self._scatter_rows(embeds, rows, features)
        return {"inputs_embeds": embeds, **out}

    def check_media_spans(self, spans: torch.Tensor | None, grid: torch.Tensor, length: int,
                          modality: str = "vision", sizes: torch.Tensor | None = None) -> torch.Tensor:
        """The spans [S, 2] (int64) of one modality after checking them against its items: the
        spans take the items' features in order, each item's features filling one span or several
        consecutive ones (S >= M: a Qwen3-VL video has one span per temporal patch, timestamps
        between), no span crossing from one item into the next, all inside the row of ``length``
        tokens."""
        m = self.modality(modality)
        if spans is None:
            raise ValueError(f"batch has {m.grid} but no {m.spans} to place the features")
        spans = spans.to(torch.long).reshape(-1, 2)
        expected = self.item_tokens(m, grid, sizes).to(spans.device)
        item_ends, span_ends = set(expected.cumsum(0).tolist()), set(spans[:, 1].cumsum(0).tolist())
        if spans.shape[0] < grid.shape[0] or int(spans[:, 1].sum()) != int(expected.sum()) or not item_ends <= span_ends:
            raise ValueError(
                f"{m.name} features do not match placeholder spans: {m.grid} {grid.tolist()} gives "
                f"{expected.tolist()} feature tokens per item, {m.spans} lengths are {spans[:, 1].tolist()}"
            )
        if int((spans[:, 0] + spans[:, 1]).max()) > length or int(spans[:, 0].min()) < 0:
            raise ValueError(f"{m.spans} {spans.tolist()} fall outside the row of {length} tokens")
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
        return self.prefix(batch).hidden

    def prefix(self, batch: dict, keep_kv: bool = False) -> "Prefix":
        """The foundation over the row. With ``prefix_lens [D]`` in the batch each document's first
        ``prefix_lens[d]`` tokens attend bidirectionally (PaliGemma's prefix-LM, a VLA frame's
        observation; components/prefix_attention.py) and the rest causally; ``keep_kv`` keeps every
        layer's keys / values in the returned layout (an action expert reads them)."""
        inputs = self.foundation_inputs(batch)
        L, device = inputs["inputs_embeds"].shape[0], inputs["inputs_embeds"].device
        cu, positions = _cu_seqlens(batch, L, device), _positions(batch, L, device)
        prefix_lens, layout = batch.get("prefix_lens"), None
        if prefix_lens is not None or keep_kv:
            if prefix_lens is None:
                prefix_lens = torch.zeros(cu.shape[0] - 1, dtype=torch.long, device=device)
            layout = PrefixLayout(cu, prefix_lens, keep_kv=keep_kv)
        hidden = self.foundation(**inputs, position_ids=positions, cu_seqlens=cu, kv_cache=layout,
                                 token_valid=batch.get("token_valid"))
        return Prefix(hidden, layout, positions)


class Prefix(NamedTuple):
    """The foundation's pass over a row: final-norm hidden states [L, D], the attention layout
    (None: plain causal documents; with kept keys / values for an action expert) and the row's
    positions."""

    hidden: torch.Tensor
    layout: PrefixLayout | None
    position_ids: torch.Tensor
