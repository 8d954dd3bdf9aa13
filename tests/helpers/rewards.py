"""A deterministic, non-constant reward for trainer tests on random tiny models (whose answers are
never right, so task rewards would be all zero and every advantage zero)."""


def distinct_token_reward(text: str, record) -> float:
    return len(set(text)) / 10.0
