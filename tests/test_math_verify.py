"""``reward.rule: math_verify`` grades as HF's math-verify package grades (the package, called
directly, is the reference): its own examples, ``\\frac{1}{2}`` against ``0.5``, ``\\boxed{}``
forms; a grading that times out or fails raises instead of scoring 0, and the trainer's process
pool (SIGALRM needs a main thread) turns that into a failed sample, never a 0; the math recipes use
it."""
from __future__ import annotations

import threading

import pytest
from math_verify import parse, verify

from megarl.config.schema import RewardConfig
from megarl.rewards import GradingFailed, RewardPool, build_reward_fn, math_answer_reward, math_verify_reward
from megarl.rewards.failures import Failure

pytestmark = pytest.mark.unit

# (gold, response) pairs from math-verify's own test-suite (tests/test_all.py), both outcomes
PACKAGE_EXAMPLES = [
    ("$9$", "Answer \\[ 9 \\]"), ("$9$", "Answer $ 9 $"), ("$9$", "Answer \\( 9 \\)"), ("$10$", "Answer \\( (9+1) \\)"),
    ("$9$", "Answer $ \n 9 \n $"), ("$1/3$", "$\\frac13 $"), ("$\\sqrt{3}$", "$\\sqrt3 $"),
    ("$1/3$", "$\\dfrac{1}{3} $"), ("$1/3$", "$\\left( \\frac{1}{3} \\right)$"), ("$1/3$", "$\\boxed{\\frac{1}{3}}$"),
    ("$1/3$", "$\\frac{1}{3} \\text{meters}$"), ("$1/3$", "$k = \\frac{1}{3}$"), ("$28\\%$", "28 percent"),
    ("$28\\%$", "$\\boxed{28}$ pct"), ("$0.28$", "28"), ("$\\frac{28}{100}$", "28"), ("$[0,1)$", "$[0,1)$"),
    ("$[0,9)$", "$[0,1)$"), ("$(0,9)$", "$[0,9)$"), ("$2-2p$", "Thus $x-p=\\boxed{2-2p}$."),
    ("$\\frac{14}{3}$", "$2+\\frac{5}{3}+1=\\boxed{\\frac{14}{3}}$"), ("$\\text{Evelyn}$", "so $\\boxed{\\text{Evelyn}}$"),
    ("${1,3} \\cup {2,4}$", "${1,2,3,4}$"), ("$x = 3$", "the answer is $3$"),
]
# the forms a math dataset's references and a model's answers take
HALF = [("\\frac{1}{2}", "0.5"), ("0.5", "\\frac{1}{2}"), ("\\frac{1}{2}", "The answer is \\boxed{0.5}."),
        ("0.5", "$\\boxed{\\frac{1}{2}}$"), ("1/2", "\\boxed{\\dfrac12}"), ("\\frac{1}{2}", "\\boxed{0.25}"),
        ("\\frac{1}{2}", "\\boxed{}"), ("\\frac{1}{2}", "no answer here")]


def package_grade(gold: str, response: str) -> float:
    """math-verify's own grading with its defaults."""
    return float(verify(parse(gold), parse(response)))


@pytest.mark.parametrize("gold,response", PACKAGE_EXAMPLES)
def test_grades_the_package_examples_as_the_package(gold, response):
    assert math_verify_reward(response, gold) == package_grade(gold, response)


@pytest.mark.parametrize("gold,response", HALF)
def test_half_and_boxed_forms_as_the_package(gold, response):
    # a bare reference is read as LaTeX math ($...$); the package graded on the same text
    assert math_verify_reward(response, gold) == package_grade(f"${gold}$", response)


def test_known_grades_and_what_the_simple_parser_misses():
    assert [math_verify_reward(r, g) for g, r in HALF] == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert math_verify_reward("blah #### 72", "Natalia sold 48 clips... #### 72") == 1.0   # GSM8K references
    assert math_verify_reward("so $x = 3$", "3") == 1.0 and math_answer_reward("so $x = 3$", "3") == 1.0
    assert math_verify_reward("$\\{1, 2\\}$", "\\{2, 1\\}") == 1.0
    assert math_answer_reward("$\\{1, 2\\}$", "\\{2, 1\\}") == 0.0      # kept: the simple parser compares strings


def test_a_grading_failure_raises_never_scores_zero(monkeypatch):
    import math_verify

    import megarl.rewards.math_verify as mv

    monkeypatch.setattr(mv, "TIMEOUT_S", 1)
    huge = "\\boxed{" + "+".join(f"x^{{{i}}}" for i in range(3000)) + "}"
    with pytest.raises(GradingFailed, match="took over 1 s") as timed_out:
        math_verify_reward(huge, "3")
    assert timed_out.value.reason == "math_verify_timeout"

    def broken(*_, **__):
        raise RuntimeError("sympy fell over")

    monkeypatch.setattr(math_verify, "verify", broken)
    with pytest.raises(GradingFailed, match="RuntimeError: sympy fell over"):
        math_verify_reward("\\boxed{3}", "3")
    with pytest.raises(GradingFailed, match="parses to nothing"):
        math_verify_reward("\\boxed{3}", "")
    said = []

    def grade_in_a_thread() -> None:
        try:
            math_verify_reward("3", "3")
        except GradingFailed as err:
            said.append(str(err))

    worker = threading.Thread(target=grade_in_a_thread)
    worker.start()
    worker.join()
    assert said and "reward.executor: process" in said[0]


def test_the_trainers_process_pool_grades_and_fails_the_sample_it_cannot_grade():
    fn = build_reward_fn(RewardConfig(kind="rule", rule="math_verify", executor="process", workers=2))
    responses = [r for _, r in HALF]
    golds = [g for g, _ in HALF]
    with RewardPool(fn, workers=2, executor="process") as pool:
        assert pool.score(responses, [_Record(g) for g in golds]) == [package_grade(f"${g}$", r) for g, r in HALF]
        assert pool.score(["\\boxed{0.5}"], [_Record("1/2")]) == [1.0]   # one sample: a worker's main thread too
        graded, failed = pool.score(["\\boxed{3}", "\\boxed{3}"], [_Record("3"), _Record("")])
    assert graded == 1.0                                     # the step goes on; the other sample is graded
    assert isinstance(failed, Failure) and failed.reason == "math_verify_reference"
    assert "GradingFailed" in failed.message and "parses to nothing" in failed.message


class _Record:
    """What the rule reward reads of a prompt record."""

    def __init__(self, answer: str) -> None:
        self.answer = answer


def test_validation_and_the_math_recipes():
    from megarl.config import load_config
    from megarl.config.loader import ConfigError
    from tests.helpers.runs import DEFAULT, ROOT

    with pytest.raises(ConfigError) as err:
        load_config(DEFAULT, ["reward.kind=rule", "reward.rule=math_verify", "reward.executor=thread"])
    assert [p.split(":")[0] for p in err.value.problems] == ["reward.executor"]
    rewards = {p.name: load_config(p).reward for p in sorted((ROOT / "recipes").glob("*.yaml"))}
    graded = {n: r for n, r in rewards.items() if r.kind == "rule"}
    by_verify = {n for n, r in graded.items() if r.rule == "math_verify"}
    # math datasets grade with math-verify; arithmetic and environment-scored recipes keep the simple parser
    assert by_verify == {n for n in graded if "smollm2" not in n and "retool" not in n}, graded
    assert all(graded[n].executor == "process" for n in by_verify)
