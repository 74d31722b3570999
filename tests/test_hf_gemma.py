"""Gemma (HF ``model_type: gemma``) against transformers' ``GemmaForCausalLM`` on tiny random models
whose sizes are not round (hidden 48, 3 heads of head_dim 20 != 48 / 3, one kv head, MLP 72, vocab
301, 3 layers): packed logits and gradients, the exact HF -> omniweave -> HF round trip of the
weights (the embedding table stays unscaled), bf16 embedding scale and norm cast bit for bit,
greedy decoding through the KV cache, the adapter's config mapping, and the shipped YAMLs.

Token ids are drawn from 1..V-1: GemmaConfig's ``pad_token_id`` is 0 and transformers builds the
embedding with ``padding_idx`` 0, so HF gives the pad row no gradient from the lookup (ours does;
the pad token is no real input of a packed row)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file

from omniweave.models.hf.export import export_hf
from omniweave.models.hf.loading import adapter_for, load_hf
from tests.hf_factory import save_tiny

REPO = Path(__file__).resolve().parents[1]
V = 301


def _pair(tmp_path, tied=True, **config):
    hf = save_tiny("gemma", tmp_path / "src", tied, vocab_size=V, **config)
    ours, cfg = load_hf(tmp_path / "src")
    return hf, ours, cfg


def _docs(lengths=(13, 22), seed=1):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, V, (n,), generator=g) for n in lengths]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = {"input_ids": torch.cat(docs), "position_ids": torch.cat([torch.arange(len(d)) for d in docs])[None],
              "cu_seqlens": cu}  # fmt: skip
    return docs, packed


@pytest.mark.parametrize("tied", [True, False])
def test_packed_row_of_two_documents_equals_transformers_on_each_alone(tmp_path, tied):
    """Logits of a packed row (13 + 22 tokens) equal GemmaForCausalLM's on each document alone
    within 1e-5 (measured 3e-8), and the gradients of the summed loss equal HF's,
    parameter by parameter, within 1e-5 relative (measured ≤ 1.4e-7)."""
    hf, ours, cfg = _pair(tmp_path, tied)
    assert cfg["foundation"]["tie_word_embeddings"] is tied
    docs, packed = _docs()
    labels = [d.roll(-1) for d in docs]
    for lab in labels:
        lab[-1] = -100
    ref = [hf(input_ids=d[None]).logits[0] for d in docs]
    got = ours.logits(packed)
    assert got.abs().max() > 0.5  # non-trivial logits
    assert (got - torch.cat(ref)).abs().max().item() <= 1e-5
    ref_loss = sum(F.cross_entropy(r, lab, reduction="sum") for r, lab in zip(ref, labels))
    ref_loss.backward()
    out = ours({**packed, "labels": torch.cat(labels)})
    torch.testing.assert_close(out.loss_sum, ref_loss, atol=1e-4, rtol=1e-6)
    out.loss_sum.backward()
    adapter, hf_params = adapter_for("gemma"), dict(hf.named_parameters())
    seen = set()
    for name, p in ours.named_parameters():
        hp = hf_params[adapter.model_name_to_hf(name)]
        assert hp.grad.norm() > 0, name
        rel = (p.grad - hp.grad).norm() / hp.grad.norm()
        assert rel.item() <= 1e-5, (name, rel.item())
        seen.add(adapter.model_name_to_hf(name))
    assert seen == set(hf_params)


@pytest.mark.parametrize("tied", [True, False])
def test_hf_to_omniweave_to_hf_round_trip_is_exact(tmp_path, tied):
    """The exported safetensors hold HF's tensors bit for bit under HF's names (the tied head stored
    once, the embedding unscaled), the config reloads as the same GemmaConfig, and transformers on
    the export gives HF's logits exactly."""
    from transformers import AutoModelForCausalLM, GemmaForCausalLM

    hf, ours, cfg = _pair(tmp_path, tied)
    src = load_file(tmp_path / "src/model.safetensors")
    assert torch.equal(ours.foundation.embed_tokens.weight, src["model.embed_tokens.weight"])  # stored unscaled
    export_hf(ours, cfg, tmp_path / "out")
    out = load_file(tmp_path / "out/model.safetensors")
    assert set(out) == set(src) and ("lm_head.weight" in out) is not tied
    for k, t in src.items():
        assert out[k].dtype == t.dtype and torch.equal(out[k], t), k
    a = json.loads((tmp_path / "src/config.json").read_text())
    b = json.loads((tmp_path / "out/config.json").read_text())
    for k in ("model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
              "tie_word_embeddings", "attention_bias", "max_position_embeddings", "pad_token_id", "bos_token_id",
              "eos_token_id"):  # fmt: skip
        assert a[k] == b[k], k
    assert b["rope_parameters"]["rope_theta"] == a["rope_parameters"]["rope_theta"]
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert type(back) is GemmaForCausalLM
    ids = torch.randint(1, V, (1, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, hf(input_ids=ids).logits)


def test_bf16_embedding_scale_and_norm_cast_match_transformers_bit_for_bit(tmp_path):
    """In bf16 the embedding scale is sqrt(48) rounded to bf16 (6.9375, not 6.9282) as in
    GemmaTextScaledWordEmbedding, and the zero-centred norm casts after the (1 + w) multiply as
    GemmaRMSNorm: both equal transformers' bits; the whole bf16 model's logits stay within 2 % of
    their range (measured 0.0078 of 2.23)."""
    hf, ours, _ = _pair(tmp_path)
    hf, ours = hf.to(torch.bfloat16), ours.to(torch.bfloat16)
    ids = torch.randint(1, V, (29,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        emb = ours.foundation.embed(ids)
        assert torch.equal(emb, hf.model.embed_tokens(ids[None])[0])
        table = ours.foundation.embed_tokens.weight[ids]
        assert torch.equal(emb, table * 6.9375) and not torch.equal(emb, (table.float() * 48**0.5).bfloat16())
        x = torch.randn(29, 48, generator=torch.Generator().manual_seed(5)).bfloat16() * 3
        for i in range(3):
            for norm in ("input_layernorm", "post_attention_layernorm"):
                got = getattr(ours.foundation.layers[i], norm)(x)
                assert torch.equal(got, getattr(hf.model.layers[i], norm)(x[None])[0]), (i, norm)
        assert torch.equal(ours.foundation.norm(x), hf.model.norm(x[None])[0])
        got, ref = ours.logits({"input_ids": ids}).float(), hf(input_ids=ids[None]).logits[0].float()
    assert (got - ref).abs().max().item() <= 0.02 * ref.abs().max().item()


def test_greedy_decoding_through_the_kv_cache_equals_transformers_argmax(tmp_path):
    """Our generation engine (packed prefill of two prompts, then the KV cache; the scaled embedding
    of each new token) picks transformers' argmax token at every step."""
    from omniweave.generation import Prompt, SamplingParams, TorchRollout

    hf, ours, _ = _pair(tmp_path)
    docs, _ = _docs((7, 12), seed=6)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    out = TorchRollout(ours).generate([Prompt(i, {"input_ids": d}) for i, d in enumerate(docs)], 1, params, seed=0)
    for d, r in zip(docs, out):
        ids, want = d[None], []
        with torch.no_grad():
            for _ in range(6):
                want.append(int(hf(input_ids=ids).logits[0, -1].argmax()))
                ids = torch.cat([ids, torch.tensor([[want[-1]]])], dim=1)
        assert r.tokens == want


def test_config_mapping_follows_gemma_config_and_refuses_what_it_cannot_hold():
    """HF config -> ours: released configs' ``gelu`` is gelu-tanh (GemmaConfig rewrites it), a
    missing head_dim is GemmaConfig's 256 (not hidden / heads), embeddings tied unless said
    otherwise, zero-centred norms and scaled embeddings on; biases and bidirectional attention are
    refused; a decoder without Gemma's options does not export as gemma."""
    from omniweave.models.components.decoder import DecoderConfig

    adapter = adapter_for("gemma")
    hf = {"model_type": "gemma", "vocab_size": 256000, "hidden_size": 2048, "intermediate_size": 16384,
          "num_hidden_layers": 18, "num_attention_heads": 8, "num_key_value_heads": 1, "hidden_act": "gelu",
          "rope_theta": 10000.0}  # fmt: skip
    ours = adapter.config_to_ours(hf)
    assert ours["hidden_act"] == "gelu_pytorch_tanh" and ours["head_dim"] == 256
    assert ours["tie_word_embeddings"] is True and ours["max_position_embeddings"] == 8192
    assert ours["norm_zero_centered"] and ours["scale_embeddings"] and not ours["qkv_bias"] and not ours["qk_norm"]
    only_4x = {k: v for k, v in hf.items() if k != "hidden_act"} | {"hidden_activation": "gelu_pytorch_tanh"}
    assert adapter.config_to_ours(only_4x)["hidden_act"] == "gelu_pytorch_tanh"
    with pytest.raises(NotImplementedError, match="attention_bias"):
        adapter.config_to_ours({**hf, "attention_bias": True})
    with pytest.raises(NotImplementedError, match="use_bidirectional_attention"):
        adapter.config_to_ours({**hf, "use_bidirectional_attention": True})
    fields = {k: v for k, v in ours.items() if k != "name"}
    back = adapter.config_to_hf(DecoderConfig(**fields))
    assert back["model_type"] == "gemma" and back["head_dim"] == 256 and back["hidden_act"] == "gelu_pytorch_tanh"
    with pytest.raises(ValueError, match="norm_zero_centered=true, scale_embeddings=true"):
        adapter.config_to_hf(DecoderConfig(**{**fields, "scale_embeddings": False}))


def test_gemma_tiny_yaml_exports_a_model_transformers_runs_identically(tmp_path):
    """gemma_tiny.yaml builds a decoder (random weights, perturbed norms) whose export loads as
    GemmaForCausalLM with equal logits (≤ 1e-5) on a packed row's documents."""
    from transformers import AutoModelForCausalLM, GemmaForCausalLM

    from omniweave.models.registry import build_model
    from tests.hf_factory import perturb_norms_and_biases

    torch.manual_seed(0)
    cfg = {"foundation": yaml.safe_load((REPO / "omniweave/configs/models/foundation/gemma_tiny.yaml").read_text())}
    ours = build_model(cfg)
    perturb_norms_and_biases(ours)
    assert ours.foundation.lm_head.weight is ours.foundation.embed_tokens.weight
    export_hf(ours, cfg, tmp_path / "out")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert type(hf) is GemmaForCausalLM and hf.config.head_dim == 20 and hf.config.num_key_value_heads == 1
    g = torch.Generator().manual_seed(7)
    docs = [torch.randint(1, 1024, (n,), generator=g) for n in (9, 16)]
    packed = {"input_ids": torch.cat(docs), "position_ids": torch.cat([torch.arange(len(d)) for d in docs])[None],
              "cu_seqlens": torch.tensor([0, 9, 25], dtype=torch.int32)}  # fmt: skip
    with torch.no_grad():
        got = ours.logits(packed)
        ref = torch.cat([hf(input_ids=d[None]).logits[0] for d in docs])
    assert (got - ref).abs().max().item() <= 1e-5


def test_gemma_2b_yaml_has_gemma_2bs_shapes_and_parameter_count():
    """gemma_2b.yaml: 2,506,172,416 parameters (tied), as transformers' GemmaForCausalLM of the
    exported config counts them (both built on the meta device)."""
    from transformers import GemmaConfig, GemmaForCausalLM

    from omniweave.models.components.decoder import param_count
    from omniweave.models.registry import build_component

    cfg = yaml.safe_load((REPO / "omniweave/configs/models/foundation/gemma_2b.yaml").read_text())
    with torch.device("meta"):
        dec = build_component("foundation", cfg)
        hf = GemmaForCausalLM(GemmaConfig(**adapter_for("gemma").config_to_hf(dec.config)))
    assert param_count(dec) == 2_506_172_416 == sum(p.numel() for p in hf.parameters())
    assert dec.layers[0].self_attn.k_proj.weight.shape == (256, 2048)  # one kv head of 256
