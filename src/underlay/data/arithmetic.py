"""A tiny built-in arithmetic prompt set with a rule-based reward, for demos and smoke tests.

Problems are ``"What is 3+4?"`` with answer ``"7"``: single-digit operands, ``+``, ``-`` (never
negative) and ``*``. The reward of a generated response is 1.0 when the first number in it equals the
answer, :data:`FORMAT_REWARD` when the response is a bare number (digits only, possibly surrounded by
spaces) of the wrong value, and 0 otherwise.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from underlay.interfaces import InvalidInput

__all__ = ["ALPHABET", "FORMAT_REWARD", "Problem", "make_problems", "reward"]

ALPHABET = "0123456789+-*=?. Whatis"
"""Every character a prompt or a correct answer can contain (a character-level vocabulary covers it)."""

FORMAT_REWARD = 0.1
"""Partial credit for answering with a bare number of the wrong value."""

_NUMBER = re.compile(r"\d+")
_BARE = re.compile(r"\s*\d+\s*\.?\s*")


@dataclass(frozen=True)
class Problem:
    """One prompt and the exact answer string expected."""

    prompt: str
    answer: str


def make_problems(n: int, seed: int) -> list[Problem]:
    """``n`` problems drawn with ``random.Random(seed)``: the same ``(n, seed)`` always gives the same list.

    Raises ``InvalidInput`` when ``n < 0``.
    """
    if n < 0:
        raise InvalidInput(f"make_problems(n={n}): n must be >= 0")
    rng = random.Random(seed)
    out: list[Problem] = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        op = rng.choice("+-*")
        if op == "-" and b > a:
            a, b = b, a
        value = a + b if op == "+" else a - b if op == "-" else a * b
        out.append(Problem(f"What is {a}{op}{b}?", str(value)))
    return out


def reward(response: str, answer: str) -> float:
    """1.0 when the first run of digits in ``response`` equals ``answer``; :data:`FORMAT_REWARD` when
    ``response`` is a bare number (optionally followed by ``.``) with the wrong value; else 0.0."""
    m = _NUMBER.search(response)
    if m is not None and m.group(0) == answer:
        return 1.0
    if _BARE.fullmatch(response):
        return FORMAT_REWARD
    return 0.0
