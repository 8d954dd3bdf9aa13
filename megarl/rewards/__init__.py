"""Rewards: rule-based verifiable scorers, reasoning-gym scorers, user functions, reward models."""
from megarl.rewards.functions import RewardFn, build_reward_fn, load_user_function, reasoning_gym_reward
from megarl.rewards.math_verify import GradingFailed, math_verify_reward
from megarl.rewards.pool import RewardPool
from megarl.rewards.rules import exact_reward, extract_answer, math_answer_reward

__all__ = ["GradingFailed", "RewardFn", "RewardPool", "build_reward_fn", "exact_reward", "extract_answer",
           "load_user_function", "math_answer_reward", "math_verify_reward", "reasoning_gym_reward"]
