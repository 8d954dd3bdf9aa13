"""A deterministic, non-constant reward for trainer tests on random tiny models (whose answers are
never right, so task rewards would be all zero and every advantage zero)."""
import threading


def distinct_token_reward(text: str, record) -> float:
    return len(set(text)) / 10.0


def slow_length_reward(text: str, record) -> float:
    """A reward that takes a while (a stand-in for a sandboxed verifier)."""
    import time

    time.sleep(0.3)
    return float(len(text)) + 0.001 * float(record)


OVERLAP = 4   # calls that must be running at once before any of them returns
_overlap = threading.Barrier(OVERLAP)


def overlapping_length_reward(text: str, record) -> float:
    """A reward that returns only once OVERLAP calls are running at the same time (a stand-in for
    slow verifiers that the pool must overlap): a pool that serialised its calls never gets past the
    barrier (BrokenBarrierError after 300 s, a hang guard). Proves overlap without timing it."""
    _overlap.wait(timeout=300)
    return float(len(text)) + 0.001 * float(record)


def verifier_down(text: str, record) -> float:
    """A reward function whose verifier is unreachable: every call raises."""
    raise ConnectionError("verifier at 10.0.0.7:8000 refused the connection")


def hangs_on_marked_records(text: str, record) -> float:
    """A reward function that never returns for records marked ``"hang"`` (a verifier in an endless
    loop) and scores the rest by length."""
    import time

    if record == "hang":
        while True:
            time.sleep(1.0)
    return float(len(text))


def hangs_once(text: str, record) -> float:
    """A transient hang: for a record ``{"once": PATH}`` the first call (the one that creates PATH)
    never returns, later calls score by length; other records score at once."""
    import os
    import time

    if isinstance(record, dict) and "once" in record:
        try:
            os.close(os.open(record["once"], os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return float(len(text))
        while True:
            time.sleep(1.0)
    return float(len(text))
