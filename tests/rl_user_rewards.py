"""Reward functions a user would write in their own module, named as 'tests.rl_user_rewards:NAME'."""


def short_answer(response: str, reference: str, max_chars: int = 10) -> float:
    """1.0 for responses of at most max_chars characters, then less, down to 0."""
    return max(0.0, 1.0 - max(0, len(response) - max_chars) / max_chars)


def fails_on_empty(response: str, reference: str) -> float:
    if not response:
        raise RuntimeError("cannot score an empty response")
    return 1.0


def nan_on_x(response: str, reference: str) -> float:
    return float("nan") if "x" in response else 0.5


def inf_on_y(response: str, reference: str) -> float:
    return float("inf") if "y" in response else 0.25


def returns_text(response: str, reference: str):
    return "1.0"


class Scorers:
    @staticmethod
    def always_one(response: str, reference: str) -> float:
        return 1.0


NOT_A_FUNCTION = 3


def vowel_fraction(response: str, reference: str) -> float:
    """A reward that varies on the random text an untrained model writes (RL plumbing tests)."""
    letters = [c for c in response.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


def raises_on_e(response: str, reference: str) -> float:
    if "e" in response:
        raise ValueError("this reward cannot read responses with an 'e'")
    return 0.5
