"""Pausing generation around weight updates, as SGLang 0.5.23's tokenizer manager does it.

SGLang's rules (``tokenizer_manager.py``: ``generate_request``, ``pause_generation``,
``continue_generation``; ``tokenizer_control_mixin.py``: every weight call;
``utils/aio_rwlock.py``):

* every ``/generate`` request first waits while the server is paused, then holds a *reader* lock of
  ``model_update_lock`` until its answer is ready;
* a weight update (and ``begin``/``end_weight_update``) takes the *writer* lock -- it waits until no
  request is in flight, and new requests wait behind it -- unless the server is paused, in which
  case it runs at once (whoever paused holds the engine still);
* ``/pause_generation`` sets the pause flag; mode ``abort`` then aborts every request and repeats
  until none holds the reader lock (all answered, with the tokens they had); modes ``retract`` and
  ``in_place`` hand the pause to the scheduler (requests stay there, retracted to the waiting queue
  with their KV freed, or kept as they are);
* ``/continue_generation`` clears the flag, resumes the scheduler and wakes the waiting requests.

``GenerationGate`` is that state for the embedded server's aiohttp app; the engine-side half
(abort, retract, pause the loop) is ``Engine.abort`` / ``Engine.pause`` / ``Engine.unpause``.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Awaitable, Callable

PAUSE_MODES = ("abort", "retract", "in_place")


class RWLock:
    """SGLang's ``aio_rwlock.RWLock``: many readers or one writer; a waiting writer blocks new
    readers (writers are not starved by a stream of requests)."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    @contextlib.asynccontextmanager
    async def reader(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and self._waiting_writers == 0)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def writer(self) -> AsyncIterator[None]:
        async with self._cond:
            self._waiting_writers += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and self._readers == 0)
                self._writer = True
            finally:
                self._waiting_writers -= 1
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()

    def is_locked(self) -> bool:
        return self._writer or self._readers > 0


class ServerClosing(RuntimeError):
    """The server is exiting: a request that waited out a pause is not started."""


class GenerationGate:
    """The pause flag and the model-update lock of one server."""

    def __init__(self) -> None:
        self.paused = False
        self.closed = False
        self.mode: str | None = None
        self._pause_cond = asyncio.Condition()
        self.lock = RWLock()

    @contextlib.asynccontextmanager
    async def generating(self) -> AsyncIterator[None]:
        """Around one ``/generate`` request: wait out a pause, then hold the reader lock.
        Raises ``ServerClosing`` once the server exits (a pause it waited on will never end)."""
        async with self._pause_cond:
            await self._pause_cond.wait_for(lambda: not self.paused or self.closed)
            if self.closed:
                raise ServerClosing("server shutting down")
        async with self.lock.reader():
            if self.closed:   # it waited behind a weight update while the server began to exit
                raise ServerClosing("server shutting down")
            yield

    async def close(self) -> None:
        """The server exits: requests waiting out a pause are answered now (``ServerClosing``)."""
        async with self._pause_cond:
            self.closed = True
            self._pause_cond.notify_all()

    @contextlib.asynccontextmanager
    async def updating(self) -> AsyncIterator[None]:
        """Around one weight call: at once when paused, else after every request in flight."""
        async with self._pause_cond:
            paused = self.paused
            if paused:   # held through the call, so a continue cannot race it (SGLang does the same)
                yield
        if not paused:
            async with self.lock.writer():
                yield

    async def pause(self, mode: str, abort_all: Callable[[], Awaitable[None]],
                    pause_engine: Callable[[str], Awaitable[None]], poll_s: float = 0.02) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        async with self._pause_cond:
            self.paused, self.mode = True, mode
            if mode != "abort":
                await pause_engine(mode)
                return
            while True:   # SGLang repeats abort_all until no request holds the reader lock
                await abort_all()
                if not self.lock.is_locked():
                    return
                await asyncio.sleep(poll_s)

    async def resume(self, resume_engine: Callable[[], Awaitable[None]]) -> None:
        async with self._pause_cond:
            self.paused, self.mode = False, None
            await resume_engine()
            self._pause_cond.notify_all()
