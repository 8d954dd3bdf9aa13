"""The OpenAI-compatible gateway a bring-your-own agent talks to while a rollout runs.

``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` (aiohttp, on the rollout
client's event loop, so every call goes through the run's ``RolloutManager``: routing, retries,
healing, pauses around weight updates, partial rollouts). Every trajectory gets its own API key
(``Authorization: Bearer <key>``, what the ``openai`` package sends): calls are attributed to their
trajectory without the agent's cooperation, and a key that is unknown -- never issued, or of a
trajectory that ended long ago -- gets 401. Keys are random per trajectory (``secrets``), the
server binds 127.0.0.1 unless told otherwise (``agent.gateway_host``): nothing but the agents of
this run reaches it.

What a call does is ``call_session.CallSession``'s; this module only routes and shapes errors.
"""
from __future__ import annotations

import asyncio
import json
import secrets
from collections import OrderedDict
from typing import Any, Optional

from aiohttp import web

from megarl.rollout.call_session import CallSession
from megarl.rollout.openai_wire import (CompletionRequest, WireError, chat_request, model_list, stream_chunks,
                                        text_request)

RECENTLY_CLOSED = 4096     # ended trajectories whose late calls still get "trajectory over" (408), not 401


def error_response(err: WireError) -> web.Response:
    """An OpenAI error body; ``x-should-retry: false`` keeps the ``openai`` package from sending a
    call again that cannot succeed (it retries 408, 429 and 5xx by default)."""
    return web.json_response(err.body(), status=err.status, headers={"x-should-retry": "false"})


class Gateway:
    """Keys -> sessions, and the HTTP server. Start and use it on one event loop."""

    def __init__(self, model: str, host: str = "127.0.0.1", port: int = 0):
        self.model, self.host, self.port = model, host, port
        self.sessions: dict[str, CallSession] = {}
        self.closed: OrderedDict[str, str] = OrderedDict()
        self._runner: Optional[web.AppRunner] = None
        self._starting: Optional[asyncio.Future] = None
        self.base_url = ""

    # ------------------------------------------------------------------ keys
    def open(self, session: CallSession) -> str:
        key = "megarl-" + secrets.token_urlsafe(24)
        self.sessions[key] = session
        return key

    def close(self, key: str, why: str) -> None:
        session = self.sessions.pop(key, None)
        if session is not None:
            session.close(why)
            self.closed[key] = why
            while len(self.closed) > RECENTLY_CLOSED:
                self.closed.popitem(last=False)

    def _session(self, request: web.Request) -> CallSession:
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        session = self.sessions.get(key)
        if session is not None:
            return session
        if key in self.closed:
            raise WireError(408, f"this trajectory is over ({self.closed[key]}); no more calls are served for its key",
                            "timeout", "trajectory_closed")
        raise WireError(401, "unknown API key: each trajectory's calls must carry the api_key megarl gave its agent",
                        "invalid_request_error", "invalid_api_key")

    # ------------------------------------------------------------------ HTTP
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        return app

    async def start(self) -> str:
        """Serve (once, however many trajectories ask at the same time); returns the base URL agents
        get (``http://HOST:PORT/v1``)."""
        if self._starting is None or (self._starting.done() and self._runner is None):
            self._starting = asyncio.ensure_future(self._start())
        return await asyncio.shield(self._starting)

    async def _start(self) -> str:
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]   # port 0: the one the system chose
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        self._runner, self.base_url = runner, f"http://{host}:{port}/v1"
        return self.base_url

    async def stop(self) -> None:
        for key in list(self.sessions):
            self.close(key, "the rollout ended")
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._starting = None

    async def _body(self, request: web.Request) -> Any:
        try:
            return json.loads(await request.read() or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WireError(400, f"the request body is not JSON: {e}") from None

    async def _answer(self, request: web.Request, req: CompletionRequest, completion: dict[str, Any]) -> web.StreamResponse:
        """The completion as JSON, or as server-sent events when the agent asked to stream."""
        if not req.stream:
            return web.json_response(completion)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for chunk in stream_chunks(completion, req.include_usage):
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            session = self._session(request)
            req = chat_request(await self._body(request))
            return await self._answer(request, req, await session.chat(req))
        except WireError as err:
            return error_response(err)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - a gateway bug answers 500 with its words, never a hang
            return error_response(WireError(500, f"gateway error: {type(err).__name__}: {err}", "server_error"))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            session = self._session(request)
            req = text_request(await self._body(request))
            return await self._answer(request, req, await session.complete(req))
        except WireError as err:
            return error_response(err)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001
            return error_response(WireError(500, f"gateway error: {type(err).__name__}: {err}", "server_error"))

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session(request)
        except WireError as err:
            return error_response(err)
        return web.json_response(model_list(self.model))


__all__ = ["Gateway", "error_response"]
