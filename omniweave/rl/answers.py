"""Reading a model's answer out of its response: the ``<answer>`` span, option letters, numbers.

Pure string functions the rewards in ``rewards.py`` are built from. Each docstring says exactly
what it accepts, because a reward is only as fair as its parser.
"""

from __future__ import annotations

import re

EXTRACT_MODES = ("answer_tag", "full")
OPTION_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def extract_answer(text: str, tag: str = "answer") -> str | None:
    """Content of the last ``<tag>…</tag>`` span, stripped; None if there is none or it is blank.

    Blank counts as missing so that no reward can match an empty ``<answer></answer>``
    (substring matching rewarded exactly that in Visual-RFT, issue 176).
    """
    spans = re.findall(f"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    if not spans:
        return None
    return spans[-1].strip() or None


def answer_text(response: str, extract: str = "answer_tag", tag: str = "answer") -> str | None:
    """What the model answered: the ``<tag>`` content ("answer_tag") or the whole response
    stripped ("full", for models that answer with a bare word); None when blank or missing."""
    if extract == "answer_tag":
        return extract_answer(response, tag)
    if extract == "full":
        return response.strip() or None
    raise ValueError(f"extract must be one of {', '.join(EXTRACT_MODES)}, got {extract!r}")


def normalize_text(text: str, ignore_case: bool = True) -> str:
    """Whitespace runs collapsed to one space, ends stripped, casefolded if ``ignore_case``."""
    text = " ".join(text.split())
    return text.casefold() if ignore_case else text


# An uppercase letter that is not part of a word or number: "B", "(B)", "B.", "is B" (not "B2").
_STANDALONE_LETTER = re.compile(r"(?<![A-Za-z0-9])[A-Z](?![A-Za-z0-9])")


def option_letter(text: str, choices: str = OPTION_LETTERS) -> str | None:
    """The first standalone uppercase letter of ``text`` that is one of ``choices``, or None.

    "B", "(B)", "B. foo", "The answer is B" and "Option B: red" all give B. Lowercase letters do
    not count, and the first letter wins: "I think B" gives I and "A cat, so B" gives A, unless
    ``choices`` (e.g. "ABCD") leaves them out.
    """
    for match in _STANDALONE_LETTER.finditer(text):
        if match.group() in choices:
            return match.group()
    return None


_UNSIGNED = r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?"
# optional sign (not after a letter), the number (not inside another one), optional "/ divisor"
_NUMBER = re.compile(rf"(?:(?<![\w.])([-+\u2212]))?(?<![\d.])({_UNSIGNED})(?:\s*/\s*({_UNSIGNED}))?")


def parse_number(text: str) -> float | None:
    """The first number in ``text``, or None.

    Reads "-3", "+2", "−3" (Unicode minus), "1,234.5" (a comma only as a thousands separator:
    "3,5" reads 3), ".5", "1e-3", and "2/3" as a fraction (a zero divisor reads as None).
    A trailing "%" is ignored, so "50%" reads 50 and equals "50" but not "0.5": datasets write
    percentages as the number shown, and models add the sign. A sign counts only when it does
    not follow a letter ("COVID-19" reads 19).
    """
    match = _NUMBER.search(text)
    if match is None:
        return None
    sign, numerator, divisor = match.groups()
    value = float(numerator.replace(",", ""))
    if divisor is not None:
        denominator = float(divisor.replace(",", ""))
        if denominator == 0:
            return None
        value /= denominator
    return -value if sign in ("-", "\u2212") else value
