"""Rule-based verifiable rewards: extract the final answer of a response and compare.

Extraction order follows common math RL practice (verl's gsm8k/math scorers, DAPO): a
``\\boxed{...}`` answer wins, then a GSM8K ``#### x`` line, then an ``<answer>`` tag, then the last
number in the text.
"""
from __future__ import annotations

import re
from fractions import Fraction

from megarl.data.answers import last_boxed

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


def extract_answer(text: str) -> str | None:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().splitlines()[0].strip() if text.rsplit("####", 1)[1].strip() else None
    tag = _ANSWER_TAG.findall(text)
    if tag:
        return tag[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


_FRAC = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")


def _as_number(text: str) -> Fraction | None:
    cleaned = _FRAC.sub(r"\1/\2", text).strip().rstrip(".").replace(",", "").replace("$", "").strip()
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def normalise_reference(answer: object) -> str:
    """GSM8K references carry their reasoning before ``#### x``: keep the final answer only."""
    text = str(answer)
    return text.rsplit("####", 1)[1].strip() if "####" in text else text.strip()


def math_answer_reward(response: str, reference: object) -> float:
    """1.0 when the extracted answer equals the reference (numerically if both are numbers)."""
    predicted = extract_answer(response)
    if predicted is None:
        return 0.0
    expected = normalise_reference(reference)
    a, b = _as_number(predicted), _as_number(expected)
    if a is not None and b is not None:
        return float(a == b)
    return float(predicted.strip().strip("$").strip() == expected.strip().strip("$"))


def exact_reward(response: str, reference: object) -> float:
    return float(response.strip() == str(reference).strip())
