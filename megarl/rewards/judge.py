"""LLM-as-judge, the text side: the judge's prompt from a sample, and its grade from the answer.

Why apart from the HTTP side (``megarl/rollout/judge.py``): what a judge is asked and how its
answer is read are the recipe's choice and must be testable without a server. The template holds
``{prompt}``, ``{response}`` and ``{reference}``, replaced literally (no ``str.format``: responses
and references are full of braces -- LaTeX, JSON, code). The parser turns the judge's answer into
a score in [0, 1] or raises :class:`UnparsableGrade`: an answer without a grade is a failed sample
(``megarl/rewards/failures.py``), never a 0.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Optional, Sequence

from megarl.rewards.failures import RewardFailed

DEFAULT_TEMPLATE = """You are grading a response to a task. Judge only its correctness and \
completeness against the task and, when one is given, the reference answer; ignore style and length.

Task:
{prompt}

Reference answer:
{reference}

Response:
{response}

Give a short justification, then end with one line 'Score: N', where N is an integer from 0 (wrong \
or no answer) to 10 (fully correct)."""

PLACEHOLDERS = ("{prompt}", "{response}", "{reference}")
_EXCERPT = 120

GradeParser = Callable[[str], float]


class UnparsableGrade(RewardFailed):
    """The judge answered, but no grade could be read from its answer (reason ``judge_unparsable``)."""

    reason = "judge_unparsable"


def prompt_text(prompt: str | Sequence[dict[str, Any]]) -> str:
    """A record's prompt as the judge reads it: plain text as is; one user message as its content;
    a conversation as ``role: content`` lines."""
    if isinstance(prompt, str):
        return prompt
    messages = list(prompt)
    users = [m for m in messages if m.get("role") == "user"]
    if len(users) == 1 and all(m.get("role") in ("user", "system") for m in messages):
        return str(users[0].get("content", ""))
    return "\n\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages)


def render(template: Optional[str], prompt: str, response: str, reference: Any) -> str:
    """The judge's prompt: ``template`` (default :data:`DEFAULT_TEMPLATE`) with its placeholders
    replaced, each exactly once per occurrence, the response last (its text cannot inject a
    placeholder that is then replaced)."""
    text = DEFAULT_TEMPLATE if template is None else template
    ref = "(none given)" if reference is None or str(reference).strip() == "" else str(reference)
    return text.replace("{prompt}", prompt).replace("{reference}", ref).replace("{response}", response)


def _excerpt(text: str) -> str:
    return repr(text if len(text) <= _EXCERPT else text[:_EXCERPT // 2] + " ... " + text[-_EXCERPT // 2:])


class ScoreParser:
    """The last match of ``pattern`` in the judge's answer (group 1: the grade), mapped linearly
    from ``[low, high]`` to ``[0, 1]``; no match, or a grade outside the range, is unparsable."""

    def __init__(self, pattern: str, low: float = 0.0, high: float = 10.0):
        if not high > low:
            raise ValueError(f"reward.judge.score_range: [{low}, {high}] is empty")
        self.pattern = re.compile(pattern)
        if self.pattern.groups < 1:
            raise ValueError(f"reward.judge.score_pattern {pattern!r} has no group for the grade")
        self.low, self.high = float(low), float(high)

    def __call__(self, text: str) -> float:
        found = self.pattern.findall(text)
        if not found:
            raise UnparsableGrade(f"judge: no grade ({self.pattern.pattern}) in its answer {_excerpt(text)}")
        last = found[-1][0] if isinstance(found[-1], tuple) else found[-1]
        try:
            grade = float(last)
        except ValueError:
            raise UnparsableGrade(f"judge: grade {last!r} is not a number (answer {_excerpt(text)})") from None
        if not self.low <= grade <= self.high:
            raise UnparsableGrade(f"judge: grade {grade:g} outside [{self.low:g}, {self.high:g}] "
                                  f"(answer {_excerpt(text)})")
        return (grade - self.low) / (self.high - self.low)


def make_parser(judge_cfg: Any) -> GradeParser:
    """``reward.judge.parser``: ``score`` (:class:`ScoreParser` over ``score_pattern`` and
    ``score_range``) or a ``module:function(text) -> float`` that raises on an answer without a grade."""
    if judge_cfg.parser == "score":
        low, high = judge_cfg.score_range
        return ScoreParser(judge_cfg.score_pattern, low, high)
    from megarl.rewards.functions import load_user_function

    return load_user_function(judge_cfg.parser, "reward.judge.parser")   # type: ignore[return-value]
