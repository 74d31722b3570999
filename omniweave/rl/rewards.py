"""Reward functions scored on decoded responses, looked up by name.

A reward is ``fn(response: str, reference: str, **params) -> float``. Built-ins register with
``@reward("name")``; any other function is named ``"module.path:function"`` and imported. A
recipe lists them as ``{name, weight, ...params}``; :func:`build_rewards` checks every name and
parameter up front, and :meth:`Rewards.score` returns the weighted total per sample. How an
answer is read out of a response (tags, option letters, numbers) lives in ``answers.py``.

Two rules keep rewards honest:

- A wrong or missing answer scores 0.0, but an empty ``<answer></answer>`` is a missing answer:
  substring matching rewarded empty answers in Visual-RFT (issue 176).
- A reward that raises, or returns NaN/inf or a non-number, is a *failure*, never a silent 0:
  the sample is marked ``failed`` (total NaN) and the reason counted, so the loop can drop its
  group and report it. A reference a reward cannot read (no number, no option letter) raises:
  that is a data bug, not a wrong answer.

The same name listed twice (e.g. two ``exact_match`` with different params) is allowed; the log
keys become ``exact_match`` and ``exact_match_2``.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import inspect
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from omniweave.errors import UserError
from omniweave.rl.answers import (
    EXTRACT_MODES,
    OPTION_LETTERS,
    answer_text,
    extract_answer,
    normalize_text,
    option_letter,
    parse_number,
)

RewardFn = Callable[..., float]
_FLOAT32_MAX = torch.finfo(torch.float32).max


class RewardSpecError(UserError, ValueError):
    """A reward spec that cannot be built: unknown name, bad import, bad parameter or weight."""


def reward(name: str, check_params: Callable[[dict[str, Any]], None] | None = None):
    """Register ``fn`` as reward ``name`` in the one registry (kind ``reward``); ``check_params``
    validates its params at build time."""
    from omniweave.models.registry import register

    if ":" in name:
        raise ValueError(f"reward name {name!r} may not contain ':' (that form imports a function)")

    def deco(fn: RewardFn) -> RewardFn:
        fn.check_params = check_params
        return register("reward", name)(fn)

    return deco


def registered_rewards() -> list[str]:
    from omniweave.models.registry import names

    return names("reward")


def _registered(name: str) -> RewardFn | None:
    from omniweave.models.registry import lookup

    return lookup("reward", name)[0] if name in registered_rewards() else None


def resolve_reward(name: str) -> RewardFn:
    """The registered reward ``name``, or the callable that ``"module.path:function"`` names."""
    if (fn := _registered(name)) is not None:
        return fn
    module_name, _, attr_path = name.partition(":")
    if not module_name or not attr_path:
        raise RewardSpecError(
            f"unknown reward {name!r}; registered: {', '.join(registered_rewards())}; "
            f"or name your own function as 'module.path:function'"
        )
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module itself failing to import
        raise RewardSpecError(
            f"reward {name!r}: cannot import module {module_name!r} ({type(e).__name__}: {e})"
        ) from e
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise RewardSpecError(f"reward {name!r}: {module_name!r} has no attribute {attr_path!r}")
        target = getattr(target, part)
    if not callable(target):
        raise RewardSpecError(f"reward {name!r}: {attr_path!r} is a {type(target).__name__}, not a function")
    return target


# ---- the built-ins (parsing lives in answers.py) ----


def _check_extract(params: dict[str, Any]) -> None:
    if params.get("extract", "answer_tag") not in EXTRACT_MODES:
        raise ValueError(f"extract must be one of {', '.join(EXTRACT_MODES)}, got {params['extract']!r}")


@reward("exact_match", check_params=_check_extract)
def exact_match(
    response: str, reference: str, extract: str = "answer_tag", ignore_case: bool = True, tag: str = "answer"
) -> float:
    """1.0 if the answer equals the reference after collapsing whitespace (and case), else 0.0.

    ``extract="full"`` compares the whole response, for models that answer with a bare word.
    """
    target = normalize_text(reference, ignore_case)
    if not target:
        raise ValueError("empty reference")
    answer = answer_text(response, extract, tag)
    return float(answer is not None and normalize_text(answer, ignore_case) == target)


def _check_choices(params: dict[str, Any]) -> None:
    _check_extract(params)
    choices = params.get("choices", OPTION_LETTERS)
    if not isinstance(choices, str) or not choices or set(choices) - set(OPTION_LETTERS):
        raise ValueError(f"choices must be uppercase letters like 'ABCD', got {choices!r}")


@reward("multiple_choice", check_params=_check_choices)
def multiple_choice(
    response: str,
    reference: str,
    extract: str = "answer_tag",
    choices: str = OPTION_LETTERS,
    tag: str = "answer",
) -> float:
    """1.0 if the answer's option letter (answers.option_letter: "B", "(B)", "B. foo", "The answer
    is B") is the reference's, else 0.0. A bare reference letter may be lowercase ("b", "(b)")."""
    bare = reference.strip().strip("().").strip()
    expected = bare.upper() if len(bare) == 1 and bare.isalpha() else option_letter(reference, choices)
    if expected is None or expected not in choices:
        raise ValueError(f"reference {reference!r} names no option letter in {choices!r}")
    answer = answer_text(response, extract, tag)
    return float(answer is not None and option_letter(answer, choices) == expected)


def _check_tolerances(params: dict[str, Any]) -> None:
    _check_extract(params)
    for key in ("rel_tol", "abs_tol"):
        value = params.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
            raise ValueError(f"{key} must be a number >= 0, got {value!r}")


@reward("numeric", check_params=_check_tolerances)
def numeric(
    response: str,
    reference: str,
    rel_tol: float = 1e-6,
    abs_tol: float = 0.0,
    extract: str = "answer_tag",
    tag: str = "answer",
) -> float:
    """1.0 if the answer's first number is within tolerance of the reference's (see parse_number)."""
    expected = parse_number(reference)
    if expected is None:
        raise ValueError(f"reference {reference!r} holds no number")
    answer = answer_text(response, extract, tag)
    value = None if answer is None else parse_number(answer)
    return float(value is not None and math.isclose(value, expected, rel_tol=rel_tol, abs_tol=abs_tol))


_THINK_THEN_ANSWER = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", flags=re.DOTALL)


@reward("format")
def format_reward(response: str, reference: str) -> float:
    """1.0 if the response is ``<think>…</think>`` then ``<answer>…</answer>`` and nothing else
    (surrounding whitespace aside), with a non-blank answer; else 0.0. The reference is unused.

    As in R1-V/Long-RL's ``r1v.py`` the match is ``re.fullmatch`` with DOTALL, so repeated tags
    inside the span still pass; the answer other rewards read is the last one.
    """
    text = response.strip()
    return float(_THINK_THEN_ANSWER.fullmatch(text) is not None and extract_answer(text) is not None)


# ---- specs and scoring ----


@dataclasses.dataclass
class RewardSpec:
    name: str  # a registered name or "module.path:function"
    weight: float = 1.0
    params: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> RewardSpec:
        """``{name, weight, ...params}``: every key but name and weight is a parameter."""
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
            raise RewardSpecError(
                f"a reward spec needs a 'name' (optional: weight, parameters), got {spec!r}"
            )
        params = {k: v for k, v in spec.items() if k not in ("name", "weight")}
        return cls(name=spec["name"], weight=spec.get("weight", 1.0), params=params)


@dataclasses.dataclass
class RewardResult:
    total: torch.Tensor  # [N] fp32 weighted sum; NaN where any component failed
    per_reward: dict[str, torch.Tensor]  # log key -> [N] raw values, NaN where it failed
    errors: collections.Counter  # "<key>:raised:<Type>", "<key>:not_finite", "<key>:not_a_number"
    failed: torch.Tensor  # [N] bool
    first_error: dict[str, str]  # reason -> the first message seen, for the log


class Rewards:
    """Built reward components; :meth:`score` runs each on every (response, reference) pair."""

    def __init__(self, components: list[tuple[str, RewardSpec, RewardFn]]):
        self.components = components

    @property
    def keys(self) -> list[str]:
        return [key for key, _, _ in self.components]

    def score(self, responses: Sequence[str], references: Sequence[str]) -> RewardResult:
        if len(responses) != len(references):
            raise ValueError(f"{len(responses)} responses but {len(references)} references")
        errors: collections.Counter = collections.Counter()
        first_error: dict[str, str] = {}
        per_reward, total = {}, torch.zeros(len(responses))
        for key, spec, fn in self.components:
            values = torch.full((len(responses),), float("nan"))
            for i, (response, reference) in enumerate(zip(responses, references)):
                try:
                    value = fn(response, reference, **spec.params)
                except Exception as e:  # noqa: BLE001 - a broken reward must not stop the run, nor score 0
                    reason, message = f"{key}:raised:{type(e).__name__}", str(e)
                else:
                    if not isinstance(value, numbers.Real):
                        reason, message = (
                            f"{key}:not_a_number",
                            f"returned {type(value).__name__} {value!r:.80}",
                        )
                    elif not (math.isfinite(value) and abs(value) <= _FLOAT32_MAX):
                        reason, message = f"{key}:not_finite", f"returned {value!r}"
                    else:
                        values[i] = float(value)
                        continue
                errors[reason] += 1
                first_error.setdefault(reason, message)
            per_reward[key] = values
            total += spec.weight * values
        failed = torch.zeros(len(responses), dtype=torch.bool)
        for values in per_reward.values():
            failed |= torch.isnan(values)
        total[failed] = float("nan")  # also where the weight is 0
        return RewardResult(total, per_reward, errors, failed, first_error)


def _check_spec(spec: RewardSpec, fn: RewardFn) -> None:
    """Unknown parameters, bad values and bad weights fail at build time, not on every sample."""
    try:
        inspect.signature(fn).bind("response", "reference", **spec.params)
    except TypeError as e:
        raise RewardSpecError(f"reward {spec.name!r} {spec.params}: {e}") from None
    except ValueError:  # no signature (a builtin): let the call decide
        pass
    check = getattr(fn, "check_params", None) if _registered(spec.name) is fn else None
    if check is not None:
        try:
            check(spec.params)
        except ValueError as e:
            raise RewardSpecError(f"reward {spec.name!r}: {e}") from None
    weight = spec.weight
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
        raise RewardSpecError(f"reward {spec.name!r}: weight must be a finite number, got {weight!r}")


def build_rewards(specs: Sequence[RewardSpec | Mapping[str, Any]]) -> Rewards:
    """Rewards from specs; unknown names, imports, parameters or weights raise RewardSpecError."""
    if not specs:
        raise RewardSpecError(f"no rewards given; registered: {', '.join(registered_rewards())}")
    components, keys = [], set()
    for raw in specs:
        spec = raw if isinstance(raw, RewardSpec) else RewardSpec.from_dict(raw)
        spec = dataclasses.replace(spec, params=dict(spec.params))
        fn = resolve_reward(spec.name)
        _check_spec(spec, fn)
        key, n = spec.name, 1
        while key in keys:
            n += 1
            key = f"{spec.name}_{n}"
        keys.add(key)
        components.append((key, spec, fn))
    return Rewards(components)
