"""omniweave.rl.rewards: the built-ins on right, wrong and edge answers; specs; failures counted."""

import math

import pytest
import torch

from omniweave.rl import rewards
from omniweave.rl.rewards import (
    RewardSpec,
    RewardSpecError,
    build_rewards,
    exact_match,
    extract_answer,
    format_reward,
    multiple_choice,
    numeric,
    parse_number,
    registered_rewards,
)

USER = "tests.rl_user_rewards"


def test_extract_answer():
    assert extract_answer("<think>hm</think><answer> red </answer>") == "red"
    assert extract_answer("<answer>a</answer> then <answer>b\nc</answer>") == "b\nc"  # the last span
    assert extract_answer("<answer></answer>") is None  # empty never scores (Visual-RFT#176)
    assert extract_answer("<answer> \n </answer>") is None
    assert extract_answer("<answer>a</answer><answer> </answer>") is None  # the last one is blank
    assert extract_answer("red") is None
    assert extract_answer("<answer>red") is None  # unclosed
    assert extract_answer("<final>7</final>", tag="final") == "7"


def test_exact_match():
    assert exact_match("<answer>Red</answer>", "red") == 1.0  # case-insensitive by default
    assert exact_match("<answer>Red</answer>", "red", ignore_case=False) == 0.0
    assert exact_match("<answer> New \n  York </answer>", "new york") == 1.0  # whitespace collapsed
    assert exact_match("<answer>blue</answer>", "red") == 0.0
    assert exact_match("<answer>reddish</answer>", "red") == 0.0  # no substring matching
    assert exact_match("red", "red") == 0.0  # no tags: no answer
    assert exact_match("<answer></answer>", "red") == 0.0
    assert exact_match("<answer>red</answer><answer>blue</answer>", "blue") == 1.0
    assert exact_match("  Red\n", "red", extract="full") == 1.0  # a bare-word model
    assert exact_match("It is red", "red", extract="full") == 0.0
    assert exact_match("", "red", extract="full") == 0.0
    with pytest.raises(ValueError, match="empty reference"):
        exact_match("<answer>x</answer>", "  ")


def test_multiple_choice():
    for answer in ["B", "(B)", "B. foo", "The answer is B", " B) because", "Option B: red"]:
        assert multiple_choice(f"<answer>{answer}</answer>", "B") == 1.0, answer
    for reference in ["(B)", "b", "(b)", "B."]:
        assert multiple_choice("<answer>B</answer>", reference) == 1.0, reference
    assert multiple_choice("<answer>C</answer>", "B") == 0.0
    assert multiple_choice("<answer>B2 is red</answer>", "B") == 0.0  # B2 is no option letter
    assert multiple_choice("<answer>b</answer>", "B") == 0.0  # only uppercase letters count
    assert multiple_choice("<answer></answer>", "B") == 0.0
    assert multiple_choice("B", "B") == 0.0  # no tags
    assert multiple_choice("B", "B", extract="full") == 1.0
    # the first standalone letter wins; choices leaves out pronoun I
    assert multiple_choice("<answer>I think B</answer>", "B") == 0.0
    assert multiple_choice("<answer>I think B</answer>", "B", choices="ABCD") == 1.0
    with pytest.raises(ValueError, match="names no option letter"):
        multiple_choice("<answer>B</answer>", "red")


@pytest.mark.parametrize(
    "text,value",
    [
        ("42", 42.0),
        ("-3", -3.0),
        ("+2", 2.0),
        ("\u22123", -3.0),
        ("1,234.5", 1234.5),
        ("1,234,567", 1234567.0),
        (".5", 0.5),
        ("1e-3", 0.001),
        ("2/3", 2 / 3),
        ("2 / 4 cups", 0.5),
        ("50%", 50.0),
        ("$1,200", 1200.0),
        ("about 7 apples and 3 pears", 7.0),
        ("3,5", 3.0),
        ("COVID-19", 19.0),
        ("x = -0.25", -0.25),
        ("1/0", None),
        ("none", None),
        ("", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == (value if value is None else pytest.approx(value, rel=1e-12))


def test_numeric():
    assert numeric("<answer>1,234.5</answer>", "1234.5") == 1.0
    assert numeric("<answer>0.3333333</answer>", "1/3") == 1.0  # rel diff 1e-7 < 1e-6
    assert numeric("<answer>0.333</answer>", "1/3") == 0.0
    assert numeric("<answer>3.13</answer>", "3.14159", rel_tol=0.01) == 1.0
    assert numeric("<answer>3.1</answer>", "3.14159", rel_tol=0.01) == 0.0  # off by 1.3%
    assert numeric("<answer>0.04</answer>", "0", abs_tol=0.05) == 1.0
    assert numeric("<answer>0.04</answer>", "0") == 0.0
    assert numeric("<answer>50%</answer>", "50") == 1.0
    assert numeric("<answer>50%</answer>", "0.5") == 0.0
    assert numeric("<answer>-3</answer>", "3") == 0.0
    assert numeric("<answer>seven</answer>", "7") == 0.0  # unparseable answer: wrong, not failed
    assert numeric("<answer>1/0</answer>", "7") == 0.0
    assert numeric("<answer></answer>", "7") == 0.0
    assert numeric("7", "7") == 0.0 and numeric("7", "7", extract="full") == 1.0
    with pytest.raises(ValueError, match="holds no number"):
        numeric("<answer>7</answer>", "seven")


def test_format():
    good = "<think>count: 1, 2, 3</think>\n<answer>3</answer>"
    assert format_reward(good, "") == 1.0
    assert format_reward(f"  {good}\n", "") == 1.0  # surrounding whitespace aside
    assert format_reward("<think>\nline\nline\n</think><answer>x</answer>", "") == 1.0  # DOTALL
    assert format_reward("<answer>3</answer>", "") == 0.0  # no think
    assert format_reward("<think>a</think><answer></answer>", "") == 0.0
    assert format_reward("<think>a</think><answer>  </answer>", "") == 0.0
    assert format_reward("<think>a</think><answer>3</answer> trailing", "") == 0.0
    assert format_reward("So <think>a</think><answer>3</answer>", "") == 0.0
    assert format_reward("<think>a</think> text <answer>3</answer>", "") == 0.0
    assert format_reward("", "") == 0.0


def test_registry_names_and_decorator(monkeypatch):
    assert {"exact_match", "multiple_choice", "numeric", "format"} <= set(registered_rewards())
    from omniweave.models import registry

    monkeypatch.setitem(registry._REGISTRY, "reward", dict(registry._REGISTRY["reward"]))  # rewards are a kind

    @rewards.reward("always_half")
    def always_half(response, reference):
        return 0.5

    assert build_rewards([{"name": "always_half"}]).score(["a"], ["b"]).total.tolist() == [0.5]
    with pytest.raises(ValueError, match="already registered"):
        rewards.reward("exact_match")(always_half)
    with pytest.raises(ValueError, match="may not contain ':'"):
        rewards.reward("a:b")


def test_unknown_name_lists_registered_and_the_import_form():
    with pytest.raises(RewardSpecError, match="unknown reward 'exactmatch'; registered: .*exact_match") as e:
        build_rewards([{"name": "exactmatch"}])
    assert "'module.path:function'" in str(e.value) and isinstance(e.value, ValueError)


def test_user_function_by_module_path():
    rs = build_rewards(
        [{"name": f"{USER}:short_answer", "max_chars": 4}, {"name": f"{USER}:Scorers.always_one"}]
    )
    result = rs.score(["abcd", "abcdef"], ["", ""])
    assert rs.keys == [f"{USER}:short_answer", f"{USER}:Scorers.always_one"]
    assert result.per_reward[f"{USER}:short_answer"].tolist() == [1.0, 0.5]
    assert result.total.tolist() == [2.0, 1.5]
    bad = {
        "no_such_module_xyz:f": "cannot import module 'no_such_module_xyz'",
        f"{USER}:missing": f"'{USER}' has no attribute 'missing'",
        f"{USER}:NOT_A_FUNCTION": "'NOT_A_FUNCTION' is a int, not a function",
        f"{USER}:": "unknown reward",
    }
    for name, message in bad.items():
        with pytest.raises(RewardSpecError, match=message) as e:
            build_rewards([{"name": name}])
        assert repr(name) in str(e.value)


def test_bad_specs_fail_at_build_time():
    cases = [
        ([], "no rewards given"),
        ([{"weight": 1.0}], "needs a 'name'"),
        ([{"name": "exact_match", "ignorecase": True}], "unexpected keyword argument 'ignorecase'"),
        ([{"name": "exact_match", "extract": "tags"}], "extract must be one of answer_tag, full"),
        ([{"name": "numeric", "rel_tol": -1}], "rel_tol must be a number >= 0"),
        ([{"name": "multiple_choice", "choices": "abc"}], "choices must be uppercase letters"),
        ([{"name": "format", "weight": float("nan")}], "weight must be a finite number"),
        ([{"name": "format", "weight": "1"}], "weight must be a finite number"),
    ]
    for specs, message in cases:
        with pytest.raises(RewardSpecError, match=message):
            build_rewards(specs)


def test_weights_and_duplicate_names():
    rs = build_rewards(
        [
            RewardSpec("exact_match", weight=0.9),
            {"name": "format", "weight": 0.1},
            {"name": "exact_match", "weight": 0.0, "extract": "full"},  # logged, not trained on
        ]
    )
    assert rs.keys == ["exact_match", "format", "exact_match_2"]
    responses = [
        "<think>t</think><answer>red</answer>",
        "<answer>red</answer>",
        "red",
        "<think></think><answer>x</answer>",
    ]
    result = rs.score(responses, ["red"] * 4)
    assert result.per_reward["exact_match"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert result.per_reward["format"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert result.per_reward["exact_match_2"].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert result.total.tolist() == pytest.approx([1.0, 0.9, 0.0, 0.1])
    assert result.total.dtype == torch.float32 and not result.failed.any() and not result.errors


def test_failures_are_counted_never_zero():
    rs = build_rewards(
        [
            {"name": "exact_match"},
            {"name": f"{USER}:fails_on_empty"},
            {"name": f"{USER}:nan_on_x", "weight": 0.0},  # a zero weight does not hide a failure
            {"name": f"{USER}:inf_on_y"},
            {"name": "numeric"},
        ]
    )
    responses = ["<answer>1</answer>", "", "x", "y", "<answer>2</answer>"]
    references = ["1", "1", "1", "1", "two"]  # the last reference holds no number: numeric raises
    result = rs.score(responses, references)
    assert result.failed.tolist() == [False, True, True, True, True]
    assert math.isnan(result.total[1]) and result.total[0].item() == 1.0 + 1.0 + 0.0 + 0.25 + 1.0
    assert result.errors == {
        f"{USER}:fails_on_empty:raised:RuntimeError": 1,
        f"{USER}:nan_on_x:not_finite": 1,
        f"{USER}:inf_on_y:not_finite": 1,
        "numeric:raised:ValueError": 1,
    }
    assert (
        result.first_error[f"{USER}:fails_on_empty:raised:RuntimeError"] == "cannot score an empty response"
    )
    assert "holds no number" in result.first_error["numeric:raised:ValueError"]
    # a component's NaNs are only where it failed; the others still report their values
    assert result.per_reward["exact_match"].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert torch.isnan(result.per_reward[f"{USER}:nan_on_x"]).tolist() == [False, False, True, False, False]


def test_non_number_and_length_mismatch():
    rs = build_rewards([{"name": f"{USER}:returns_text"}])
    result = rs.score(["a", "b"], ["", ""])
    assert result.errors == {f"{USER}:returns_text:not_a_number": 2} and result.failed.all()
    assert result.first_error[f"{USER}:returns_text:not_a_number"] == "returned str '1.0'"
    with pytest.raises(ValueError, match="2 responses but 1 references"):
        rs.score(["a", "b"], [""])
