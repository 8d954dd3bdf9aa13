"""Reward functions by kind: rules, reasoning-gym scorers, user functions by dotted path.

Every reward function has one signature, ``fn(response_text, record) -> float``, so the trainer
scores samples the same way whatever the kind; model-based rewards score batches on a worker.
"""
from __future__ import annotations

import functools
import importlib
from typing import Any, Callable

from megarl.data.records import PromptRecord
from megarl.rewards.math_verify import math_verify_reward
from megarl.rewards.rules import exact_reward, math_answer_reward

RewardFn = Callable[[str, PromptRecord], float]
RULES: dict[str, Callable[[str, Any], float]] = {"math_answer": math_answer_reward, "math_verify": math_verify_reward,
                                                 "exact": exact_reward}


def reasoning_gym_reward(response: str, record: PromptRecord) -> float:
    """Score with the task's own scorer (reasoning-gym gives partial credit for near answers)."""
    import reasoning_gym

    entry = record.metadata.get("reasoning_gym")
    if entry is None:
        raise ValueError("reward.kind reasoning_gym needs prompts from data.source reasoning_gym")
    scorer = reasoning_gym.get_score_answer_fn(entry["metadata"]["source_dataset"])
    return float(scorer(answer=response.strip(), entry=entry))


def load_user_function(dotted: str, field: str = "reward.function") -> RewardFn:
    """The callable ``module:function`` names (``field``: the config field, for the error)."""
    module_name, _, attr = dotted.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{field} {dotted!r}: cannot import {module_name!r}: {err}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{field} {dotted!r}: {module_name} has no callable {attr!r}")
    return fn


def _rule_reward(rule: Callable[[str, Any], float], response: str, record: PromptRecord) -> float:
    return rule(response, record.answer)


def build_reward_fn(reward_cfg: Any) -> RewardFn:
    """The per-sample reward for a ``RewardConfig`` (kind=model is scored by the reward-model worker)."""
    if reward_cfg.kind == "reasoning_gym":
        return reasoning_gym_reward
    if reward_cfg.kind == "rule":
        return functools.partial(_rule_reward, RULES[reward_cfg.rule])  # picklable: reward.executor=process
    if reward_cfg.kind == "function":
        return load_user_function(reward_cfg.function)
    raise ValueError(f"reward.kind {reward_cfg.kind!r} is scored by a model (a worker or a judge server), not a function")
