"""A deterministic, non-constant reward for trainer tests on random tiny models (whose answers are
never right, so task rewards would be all zero and every advantage zero)."""


def distinct_token_reward(text: str, record) -> float:
    return len(set(text)) / 10.0


def slow_length_reward(text: str, record) -> float:
    """A reward that takes a while (a stand-in for a sandboxed verifier): the pool must overlap calls."""
    import time

    time.sleep(0.3)
    return float(len(text)) + 0.001 * float(record)
