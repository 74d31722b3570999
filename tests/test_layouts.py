"""Which training mode runs under which layout (omniweave/train/layouts.py): the one capability
check, its one-line refusals, the objectives it reasons about, the docs' table, and the import
graph that keeps parallel/ free of the recipe's training modes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from omniweave.config import load_recipe
from omniweave.train import layouts
from omniweave.train.layouts import Layout, LayoutError, Traits, check, refusals, traits

ROOT = Path(__file__).resolve().parents[1]


def _recipe(name="demo", *overrides):
    return load_recipe(name, list(overrides))


def test_seq_chunks_must_be_a_positive_integer():
    with pytest.raises(LayoutError, match="parallel.seq_chunks=0: the number of chunks"):
        check(_recipe("demo", "parallel.seq_chunks=0"))


@pytest.mark.parametrize("overrides, reason", [
    (("parallel.seq_chunks=4", "parallel.cp=2"), "parallel.seq_chunks=4 with parallel.cp=2: chunked rows and context"),
    (("parallel.seq_chunks=4", "model.foundation.tp=2"), "with model.foundation.tp=2: a chunk's K/V store"),
    (("parallel.seq_chunks=4", "parallel.pp=2"), "set parallel.pp_schedule=gpipe and parallel.pp_virtual=1 (got 1f1b, 1)"),
    (("parallel.pp=2", "data.mix=[{path: a}, {path: b}]"), "parallel.pp=2 with data.mix: the stage split"),
], ids=["chunks-cp", "chunks-tp", "chunks-pp-1f1b", "pp-mix"])
def test_layouts_that_cannot_run_say_why_in_one_line(overrides, reason):
    with pytest.raises(LayoutError, match=reason.replace("(", r"\(").replace(")", r"\)")) as e:
        check(_recipe("demo", *overrides))
    assert "\n" not in str(e.value)


def test_moe_chunks_and_the_reference_under_a_pipeline_are_refused():
    with pytest.raises(LayoutError, match=r"a MoE foundation \(model.foundation.num_experts\)"):
        check(_recipe("demo_moe", "parallel.seq_chunks=2"))
    with pytest.raises(LayoutError, match=r"train.dpo.ref=model under parallel.pp=2: .* precompute-ref"):
        check(_recipe("demo_dpo", "parallel.pp=2"))
    with pytest.raises(LayoutError, match=r"rl.kl_coef > 0 under parallel.pp=2: .*set rl.kl_coef=0"):
        check(_recipe("demo_grpo", "parallel.pp=2", "rl.kl_coef=0.05"))
    with pytest.raises(LayoutError, match=r"all-reduced over the cp group"):
        check(_recipe("demo_dpo", "parallel.pp=2", "parallel.cp=2", "train.dpo.ref=none"))


@pytest.mark.parametrize("name, overrides", [
    ("demo_dpo", ("parallel.seq_chunks=4",)),
    ("demo_dpo", ("parallel.pp=2", "parallel.seq_chunks=2", "parallel.pp_schedule=gpipe", "train.dpo.ref=none")),
    ("demo_grpo", ("parallel.seq_chunks=2",)),
    ("demo_grpo", ("parallel.pp=2", "parallel.cp=2")),
    ("demo_grpo", ("parallel.pp=2", "parallel.seq_chunks=2", "parallel.pp_schedule=gpipe")),
    ("demo", ("parallel.pp=2", "parallel.seq_chunks=4", "parallel.pp_schedule=gpipe")),
])
def test_every_mode_runs_where_the_math_allows(name, overrides):
    check(_recipe(name, *overrides))


def test_the_traits_are_the_objectives_own():
    """The check reasons from the recipe, before any objective exists: its traits must be the
    objectives' (a sequence-level loss is carried across chunks; a token sum is not)."""
    from omniweave.rl.objective import GRPOObjective
    from omniweave.train.dpo import DPOObjective
    from omniweave.train.objective import TokenCrossEntropy

    assert traits(_recipe("demo")).token_sum is TokenCrossEntropy.token_sum is True
    assert traits(_recipe("demo_dpo")).token_sum is DPOObjective.token_sum is False
    assert traits(_recipe("demo_grpo")).token_sum is GRPOObjective.token_sum is True
    assert traits(_recipe("demo_dpo", "train.dpo.ref=precomputed")).reference_forward is None
    assert traits(_recipe("demo_grpo", "rl.kl_coef=0.1")).reference_forward == "rl.kl_coef > 0"


def test_the_docs_table_is_the_checks_own():
    table = layouts.table()
    assert table in (ROOT / "docs" / "training.md").read_text(), "docs/training.md: paste layouts.table()"
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table.splitlines()[2:]}
    assert rows["SFT / pretraining"] == ["✓"] * len(layouts.LAYOUTS)
    assert rows["GRPO, `rl.kl_coef > 0`"][list(layouts.LAYOUTS).index("pp")] == "✗"
    assert refusals(Traits("x"), Layout(pp=2, seq_chunks=2, pp_schedule="gpipe")) == []


def _package_imports(package: str) -> set[str]:
    """The omniweave sub-packages a package's modules import, at any level (function bodies too)."""
    out = set()
    for path in (ROOT / "omniweave" / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            out.update(n.split(".")[1] for n in names if n.startswith("omniweave.") and n.count(".") >= 1)
    return out - {package}


def test_train_parallel_and_rl_import_each_other_without_a_cycle():
    """parallel/ knows no training mode (it never imports train/ or rl/); rl/ builds on train/,
    never the reverse (generation, which both use, lives beside them: omniweave/generation.py)."""
    graph = {p: _package_imports(p) & {"train", "parallel", "rl"} for p in ("train", "parallel", "rl")}
    assert graph["parallel"] == set(), graph
    assert "rl" not in graph["train"], graph
