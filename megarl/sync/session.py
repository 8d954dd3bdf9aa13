"""Driver side of a weight push: one SGLang weight-update session around all sender ranks.

SGLang 0.5.23 applies `/update_weights_from_distributed` and `/update_weights_from_tensor` only
between `POST /begin_weight_update` and `POST /end_weight_update`
(`scheduler_components/weight_updater.py`); the session is one per server, not one per update
group, so it cannot be opened by the sender ranks themselves (a run has one sender per pipeline
stage / expert rank, pushing concurrently). The driver opens it on every server, lets the ranks
stream, and closes it -- also when a rank failed, so the servers are left usable and the failure
that ended the push is the one reported.

    with weight_update_session(urls, api_key=key):
        actor_group.call("push_weights", target, version)
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

from megarl.rollout.client import LoopThread, RequestFailed, SGLangClient


class SyncError(RuntimeError):
    """A weight push failed; the message names the server(s) and, where known, the tensor."""


class _Failures(list):
    """One line per failed server; ``first`` is the first exception (the cause a SyncError names,
    so ``megarl.errors`` sees a refused key or an unreachable server behind it)."""

    first: Optional[BaseException] = None


def server_failures(clients: Sequence[SGLangClient], futures, timeout_s: float) -> _Failures:
    """Wait for one future per client; one line per failed server (naming its URL)."""
    errors = _Failures()
    for client, fut in zip(clients, futures):
        try:
            fut.result(timeout_s)
        except RequestFailed as e:
            errors.append(f"{client.url}: {e.message}")
            errors.first = errors.first or e
        except Exception as e:  # noqa: BLE001 - connection errors, timeouts: name the server
            errors.append(f"{client.url}: {type(e).__name__}: {e}")
            errors.first = errors.first or e
    return errors


@contextlib.contextmanager
def session_on(clients: Sequence[SGLangClient], io: LoopThread, timeout_s: float = 120.0) -> Iterator[None]:
    """begin on every server (concurrently) -> body -> end on every server that began."""
    begun_futures = [io.submit(c.begin_weight_update()) for c in clients]
    errors, begun = _Failures(), []
    for client, fut in zip(clients, begun_futures):
        failure = server_failures([client], [fut], timeout_s)
        (errors.extend(failure) if failure else begun.append(client))
        errors.first = errors.first or failure.first
    if errors:
        _end(begun, io, timeout_s)
        raise SyncError("begin_weight_update refused: " + "; ".join(errors)) from errors.first
    try:
        yield
    except BaseException:
        _end(begun, io, timeout_s)  # best effort: the body's failure is the one to report
        raise
    end_errors = _end(begun, io, timeout_s)
    if end_errors:
        raise SyncError("end_weight_update failed: " + "; ".join(end_errors)) from end_errors.first


def _end(clients: Sequence[SGLangClient], io: LoopThread, timeout_s: float) -> _Failures:
    return server_failures(clients, [io.submit(c.end_weight_update()) for c in clients], timeout_s)


@contextlib.contextmanager
def weight_update_session(urls: Sequence[str], api_key: Optional[str] = None,
                          timeout_s: float = 120.0) -> Iterator[None]:
    """`session_on` for callers without clients of their own (the trainer's driver)."""
    io = LoopThread()
    clients = [SGLangClient(u, timeout_s=timeout_s, retries=0, api_key=api_key) for u in urls]
    try:
        with session_on(clients, io, timeout_s):
            yield
    finally:
        close_clients(clients, io)


def close_clients(clients: Sequence[SGLangClient], io: LoopThread) -> None:
    """Close short-lived clients and their loop; never raises (teardown)."""
    for c in clients:
        try:
            io.run(c.close(), timeout=5)
        except Exception:  # noqa: BLE001 - closing sockets at teardown
            pass
    io.close()
