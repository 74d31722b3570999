"""Recipe composition: defaults lists resolve component groups, every recipe sits on one shared
schema (so any documented key is overridable without ``+``), and user mistakes are one-line
``RecipeError``s naming the closest valid key."""

import textwrap

import pytest

from omniweave import config
from omniweave.config import RecipeError


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


@pytest.fixture
def configs(tmp_path, monkeypatch):
    _write(tmp_path / "models/foundation/tiny.yaml", "hidden: 8\nlayers: 2\n")
    _write(tmp_path / "recipes/r.yaml", """\
        defaults:
          - foundation@model.foundation: tiny
          - _self_
        train:
          steps: 3
        """)
    monkeypatch.setattr(config, "CONFIGS_DIR", tmp_path)
    return tmp_path


def test_recipe_composes_components_and_overrides_on_the_schema(configs):
    cfg = config.load_recipe("r", ["train.steps=5", "model.foundation.layers=4", "data.num_workers=2"])
    d = config.to_dict(cfg)
    assert d["model"] == {"foundation": {"hidden": 8, "layers": 4}}
    assert d["train"]["steps"] == 5 and d["data"]["num_workers"] == 2
    # everything else is the schema's default; output_dir defaults to runs/<recipe>
    defaults = config.schema_defaults()
    assert d["train"]["betas"] == defaults["train.betas"] == [0.9, 0.95]
    assert d["parallel"]["cp"] == 1 and d["eval"]["max_new_tokens"] == defaults["eval.max_new_tokens"]
    assert d["output_dir"] == "runs/r"


def test_documented_keys_need_no_plus(configs):
    cfg = config.load_recipe("r", ["data.num_workers=1", "train.betas=[0.8,0.99]", "train.eps=1e-6",
                                   "train.max_bad_steps=2", "data.vision.max_pixels=12544"])
    assert cfg.data.num_workers == 1 and list(cfg.train.betas) == [0.8, 0.99] and cfg.train.eps == 1e-6
    assert cfg.train.max_bad_steps == 2 and cfg.data.vision.max_pixels == 12544


@pytest.mark.parametrize("override, message", [
    ("data.num_worker=1", "unknown recipe key 'data.num_worker'; did you mean 'data.num_workers'?"),
    ("trian.steps=1", "unknown recipe key 'trian.steps'; did you mean 'train.steps'?"),
    ("model.foundation.layer=3", "did you mean 'model.foundation.layers'?"),
    ("train.steps=ten", "train.steps: 'ten' is not a valid integer"),
    ("foundation@model.foundation=huge", "no component config 'foundation/huge'; available: tiny"),
])
def test_user_mistakes_are_one_line(configs, override, message):
    with pytest.raises(RecipeError) as e:
        config.load_recipe("r", [override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_unknown_key_in_a_recipe_file_is_named(configs):
    _write(configs / "recipes/typo.yaml", "train:\n  global_bach: 4\n")
    with pytest.raises(RecipeError, match=r"unknown recipe key 'train.global_bach'; did you mean 'train.global_batch'"):
        config.load_recipe("typo")


def test_missing_recipe_names_the_closest_builtin(configs):
    with pytest.raises(RecipeError, match=r"recipe 'rr' not found.*did you mean 'r'\?"):
        config.load_recipe("rr")


def test_required_keys_left_unset_are_one_line(configs):
    cfg = config.load_recipe("r")
    config.require(cfg, "train.steps")
    with pytest.raises(RecipeError, match=r"^data.path is not set; pass data.path=VALUE"):
        config.require(cfg, "data.path")


def test_a_component_field_its_yaml_leaves_at_the_default_is_overridden_like_any_key():
    """`model.foundation.attn_backend=math` works although qwen2_5_tiny.yaml does not list it (the
    field's default lives in DecoderConfig); a typo of it is still an unknown key with a suggestion."""
    cfg = config.load_recipe("demo", ["model.foundation.attn_backend=math", "model.foundation.num_layers=3"])
    assert cfg.model.foundation.attn_backend == "math" and cfg.model.foundation.num_layers == 3
    with pytest.raises(RecipeError, match="did you mean 'model.foundation.attn_backend'"):
        config.load_recipe("demo", ["model.foundation.attn_backnd=math"])


def test_an_unknown_offload_mode_is_refused_naming_the_key():
    """``train.offload`` is none or optimizer; anything else fails before a model is built."""
    import pytest

    from omniweave.parallel.fsdp import apply_fsdp

    with pytest.raises(ValueError, match=r"train.offload='gpu'; choose one of none, optimizer"):
        apply_fsdp(None, None, offload="gpu")


@pytest.mark.parametrize("recipe_lora, alpha_alone", [(None, {"alpha": 4}), ("lora: {r: 16, alpha: 32}", {"r": 16, "alpha": 4}),
                                                     ("lora: null", {"alpha": 4})])
def test_dotted_lora_keys_work_like_the_dict_form(configs, recipe_lora, alpha_alone):
    """``model.<component>.lora.<field>=V`` on the command line: whether the recipe has no lora
    section, one, or ``lora: null``, the section is the one the dict form gives (with or without
    Hydra's ``+``); one dotted field changes that field of the recipe's section and only it."""
    if recipe_lora:
        _write(configs / "recipes/r.yaml", f"""\
            defaults:
              - foundation@model.foundation: tiny
              - _self_
            model:
              foundation:
                {recipe_lora}
            """)
    lora = lambda overrides: config.to_dict(config.load_recipe("r", overrides).model)["foundation"]["lora"]  # noqa: E731
    dotted = ["model.foundation.lora.r=8", "model.foundation.lora.alpha=16", "model.foundation.lora.dropout=0.1",
              "model.foundation.lora.targets=[q_proj,v_proj]"]
    want = {"r": 8, "alpha": 16, "dropout": 0.1, "targets": ["q_proj", "v_proj"]}
    assert lora(dotted) == want
    if recipe_lora is None:  # the dict form, with Hydra's '+' for a key the recipe lacks or without
        for plus in ("+", ""):
            assert lora([plus + "model.foundation.lora={r: 8, alpha: 16, dropout: 0.1, targets: [q_proj, v_proj]}"]) == want
    assert lora(["model.foundation.lora.alpha=4"]) == alpha_alone


def test_a_dotted_rank_alone_takes_the_lora_defaults(configs):
    """Only ``r`` given: alpha = r (scaling 1), no dropout, every Linear (models/lora.py's defaults);
    the other fields alone leave the rank missing, which the model build names."""
    from omniweave.errors import UserError
    from omniweave.models.lora import ALL_LINEAR, LoraConfig, lora_configs

    model = config.to_dict(config.load_recipe("r", ["model.foundation.lora.r=8"]).model)
    assert lora_configs(model) == {"foundation": LoraConfig(r=8, alpha=8.0, dropout=0.0, targets=ALL_LINEAR)}
    model = config.to_dict(config.load_recipe("r", ["model.foundation.lora.alpha=8"]).model)
    with pytest.raises(UserError, match=r"^model.foundation.lora.r is required"):
        lora_configs(model)


@pytest.mark.parametrize("recipe_lora", [None, "lora: {r: 16}"])
def test_an_unknown_dotted_lora_field_names_the_valid_ones(configs, recipe_lora):
    if recipe_lora:
        _write(configs / "recipes/r.yaml", f"defaults:\n  - foundation@model.foundation: tiny\n  - _self_\n"
                                           f"model:\n  foundation:\n    {recipe_lora}\n")
    with pytest.raises(RecipeError) as e:
        config.load_recipe("r", ["model.foundation.lora.rank=8"])
    assert str(e.value) == "model.foundation.lora.rank: unknown LoRA field; valid: r, alpha, dropout, targets"


# ---------------------------------------------------------------------------- omniweave recipes

def test_recipe_listing_describes_each_recipe_by_its_first_sentence_or_its_wiring(configs):
    """A leading comment gives its first sentence without (asides, even (nested) ones); no comment:
    what the defaults list wires, a parent recipe as ``on NAME``; the listing ends with the folder."""
    from omniweave import recipes

    _write(configs / "recipes/commented.yaml", """\
        # Tiny stack (one layer (no MoE)) on a toy backbone: for tests. Second sentence.
        # More comment.
        defaults:
          - r
          - _self_
        """)
    _write(configs / "recipes/child.yaml", """\
        defaults:
          - r
          - override foundation@model.foundation: other
          - _self_
        train:
          steps: 4
        """)
    assert recipes.builtin_recipes() == {
        "child": "on r, foundation other",
        "commented": "Tiny stack on a toy backbone: for tests",
        "r": "foundation tiny",
    }
    assert recipes.listing().splitlines() == [
        "child      on r, foundation other",
        "commented  Tiny stack on a toy backbone: for tests",
        "r          foundation tiny",
        "",
        f"3 built-in recipes in {configs / 'recipes'}; use one by name (omniweave train NAME, "
        "data pack --recipe NAME) or copy it and pass the YAML path"]


def test_a_long_first_sentence_is_cut_at_110_characters_with_an_ellipsis(configs):
    from omniweave import recipes

    _write(configs / "recipes/long.yaml", "# " + "word " * 40 + "\ntrain:\n  steps: 1\n")
    text = recipes.description(configs / "recipes/long.yaml")
    assert len(text) == 110 and text == ("word " * 22)[:109].rstrip() + "…"


# ---------------------------------------------------------------------------- typed recipe reads

# the modules that read recipe sections (train, data, parallel, eval, rl; model components, their
# common keys and lora) through their typed schema: config.section, registry.common_config, a
# component's registered config dataclass, models/lora.LoraConfig (issue 33, item 7)
TYPED_READERS = ("parallel/dims.py", "parallel/cost_model.py", "models/registry.py", "models/lora.py",
                 "models/components/decoder.py", "models/hf/export.py", "models/hf/processor_files.py",
                 "train/schedule.py", "train/optim.py", "train/pipeline_setup.py", "train/dpo_ref.py")
NOT_RECIPE_READS = {("train/optim.py", "lr")}  # apply_recipe: an optimizer param group's own rate, else train.lr


def _recipe_keys() -> set[str]:
    """Every key a recipe may set: the schema's (last name of each dotted key), a component's
    common and LoRA keys, and the fields of every registered component config."""
    import dataclasses

    from omniweave.models import registry
    from omniweave.models.lora import LORA_KEYS

    keys = {k.rsplit(".", 1)[-1] for k in config.schema_defaults()} | set(registry.COMMON_KEYS) | set(LORA_KEYS)
    for kind in registry.MODEL_SECTIONS:
        keys |= {f.name for name in registry.names(kind) for f in dataclasses.fields(registry.lookup(kind, name)[1])}
    return keys


def test_recipe_readers_state_no_default_beside_the_schema():
    """No ``x.get("<recipe key>", <default>)`` in the modules that read the recipe: the default is
    the schema's, stated once (a second copy drifts: the cost model's projector read
    ``deepstack_levels`` 0 where Qwen3MergerConfig, the model, says 3)."""
    import ast
    from pathlib import Path

    keys, root, found = _recipe_keys(), Path(config.__file__).resolve().parent, []
    assert {"pp_schedule", "template", "freeze", "tp", "alpha", "qkv_bias", "deepstack_levels"} <= keys
    for rel in TYPED_READERS:
        for node in ast.walk(ast.parse((root / rel).read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) and node.args[0].value in keys
                    and (rel, node.args[0].value) not in NOT_RECIPE_READS):
                found.append(f"omniweave/{rel}:{node.lineno} .get({node.args[0].value!r}, …)")
    assert not found, "recipe keys read with a default of their own (read them through the schema): " + "; ".join(found)


def test_a_partial_recipe_gets_the_schemas_defaults_through_the_typed_reads():
    """What a recipe leaves out is the schema's: LoRA's alpha = r, no dropout, every Linear
    (LoraConfig); a component's common keys (CommonConfig); a qwen3_merger projector without
    ``deepstack_levels`` costs Qwen3MergerConfig's levels; ``data.template`` its schema default."""
    from omniweave.models.components.qwen3_vit import Qwen3MergerConfig
    from omniweave.models.lora import ALL_LINEAR, LoraConfig, parse_lora
    from omniweave.models.registry import CommonConfig, common_config
    from omniweave.parallel.cost_model import CostModel

    assert parse_lora("foundation", {"r": 4}) == LoraConfig(r=4, alpha=4.0, dropout=0.0, targets=ALL_LINEAR)
    assert common_config({"name": "decoder"}) == CommonConfig(name="decoder") and common_config(None).tp == 1
    foundation = {"name": "decoder", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 16, "num_layers": 2,
                  "num_heads": 2, "num_kv_heads": 1}
    cost = lambda **proj: CostModel.from_model_config(  # noqa: E731
        {"foundation": foundation, "image_encoder": {"name": "qwen3_vit"}, "projector": {"name": "qwen3_merger", **proj}})
    assert cost() == cost(deepstack_levels=Qwen3MergerConfig.deepstack_levels) != cost(deepstack_levels=0)
    assert config.section({"data": {"tokenizer": "demo"}}, "data").template == config.DataSchema.template
