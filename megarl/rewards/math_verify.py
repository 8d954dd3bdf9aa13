"""``reward.rule: math_verify``: math answers graded by HF's ``math-verify`` package.

Why: megarl's own ``math_answer`` parser compares the last boxed / tagged / trailing number, so
``\\frac{1}{2}`` against ``0.5``, sets, intervals, matrices or ``x = 3`` against ``3`` are judged by
string equality or not at all; math-verify parses both sides to sympy (LaTeX and plain
expressions) and compares them symbolically and numerically -- the grader most math RL recipes use.

The answer is graded exactly as the package grades it: ``verify(parse(gold), parse(response))``
with the package's default extraction (LaTeX with ``\\boxed{}`` first, then plain expressions). A
reference without math delimiters (``0.5``, ``\\frac{1}{2}``, a GSM8K ``#### 72`` line) is wrapped
in ``$...$`` so the LaTeX extractor reads it whole.

A grading that fails -- a parse or comparison that times out (math-verify's own limit, by
``SIGALRM``), an exception inside the package, a reference that parses to nothing -- raises
:class:`GradingFailed` naming the reason and a piece of the response: it is never scored 0,
because a grader failure is not a wrong answer. The reward pool marks such a sample failed (kept
out of the advantage and the loss, counted by reason: ``megarl/rewards/failures.py``).
``SIGALRM`` needs the main thread, so the trainer grades in worker processes
(``reward.executor: process``; validation says so).
"""
from __future__ import annotations

import threading

from megarl.rewards.failures import RewardFailed
from megarl.rewards.rules import normalise_reference

# math-verify's own defaults for parse and verify (seconds, per call)
TIMEOUT_S = 5
_EXCERPT = 120


class GradingFailed(RewardFailed):
    """math-verify could not grade a response (timeout, error, unreadable reference); ``reason``
    says which (``math_verify_timeout``, ``math_verify_error``, ``math_verify_reference``)."""

    reason = "math_verify_error"


def gold_text(reference: object) -> str:
    """The reference as math-verify should read it: GSM8K's final answer only, in ``$...$`` unless
    it already carries math delimiters or a ``\\boxed{}``."""
    text = normalise_reference(reference)
    if "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text:
        return text
    return f"${text}$"


def _excerpt(text: str) -> str:
    return repr(text if len(text) <= _EXCERPT else text[:_EXCERPT // 2] + " ... " + text[-_EXCERPT // 2:])


def math_verify_reward(response: str, reference: object) -> float:
    """1.0 when math-verify finds the response's answer equivalent to the reference, else 0.0;
    :class:`GradingFailed` when it cannot tell."""
    if threading.current_thread() is not threading.main_thread():
        raise GradingFailed("reward.rule math_verify runs math-verify's SIGALRM timeouts, which need a main "
                            "thread: grade in worker processes (reward.executor: process)", "math_verify_thread")
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    gold = gold_text(reference)
    try:
        expected = parse(gold, parsing_timeout=TIMEOUT_S, raise_on_error=True)
        if not expected:
            raise GradingFailed(f"math_verify: the reference {_excerpt(gold)} parses to nothing", "math_verify_reference")
        predicted = parse(response, parsing_timeout=TIMEOUT_S, raise_on_error=True)
        if not predicted:   # no answer in the response: a wrong answer, graded as the package grades it
            return 0.0
        return float(verify(expected, predicted, timeout_seconds=TIMEOUT_S, raise_on_error=True))
    except GradingFailed:
        raise
    except TimeoutException:
        raise GradingFailed(f"math_verify: grading took over {TIMEOUT_S} s (response {_excerpt(response)})",
                            "math_verify_timeout") from None
    except Exception as err:   # noqa: BLE001 -- any error inside the package: say which, never a 0
        raise GradingFailed(f"math_verify: {type(err).__name__}: {str(err)[:_EXCERPT]} "
                            f"(response {_excerpt(response)})") from err

