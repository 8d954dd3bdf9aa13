"""API-key check of the embedded server: SGLang's decision, with only `api_key` configured.

SGLang 0.5.23 (`sglang/srt/utils/auth.py::decide_request_auth`): OPTIONS and every path starting
with /health, /ready or /metrics are always allowed (probes, scrapers); otherwise, when a key is
configured, the request needs `Authorization: Bearer <key>` (scheme case-insensitive, token
compared in constant time); a refusal answers 401 `{"error": "Unauthorized"}`. With only
`api_key` set the NORMAL and ADMIN_OPTIONAL levels decide the same, so one rule covers every
endpoint here.

The key never appears on the command line (argv is world-readable in /proc): it is read from an
environment variable, `MEGARL_API_KEY` unless `--api-key-env` names another one.
"""
from __future__ import annotations

import hmac
import logging
import os
from typing import Awaitable, Callable, Optional

from aiohttp import web

log = logging.getLogger("megarl.engine")

DEFAULT_API_KEY_ENV = "MEGARL_API_KEY"
_OPEN_PREFIXES = ("/health", "/ready", "/metrics")


def read_api_key(env_name: str = DEFAULT_API_KEY_ENV) -> Optional[str]:
    """The key from `env_name` (None when unset or empty)."""
    key = os.environ.get(env_name, "")
    return key or None


def _bearer_ok(authorization: Optional[str], key: str) -> bool:
    if not authorization:
        return False
    parts = authorization.split(" ", 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return False
    # bytes: constant-time for any header text (str compare_digest refuses non-ASCII)
    return hmac.compare_digest(parts[1].encode("utf-8", "surrogateescape"), key.encode("utf-8"))


def allowed(method: str, path: str, authorization: Optional[str], api_key: Optional[str]) -> bool:
    """Whether a request passes (same answer as SGLang's `decide_request_auth` with `api_key`
    only and `admin_api_key=None`)."""
    if method == "OPTIONS" or path.startswith(_OPEN_PREFIXES):
        return True
    if not api_key:
        return True
    return _bearer_ok(authorization, api_key)


def api_key_middleware(api_key: Optional[str]) -> Callable:
    """aiohttp middleware answering 401 as SGLang does when `allowed` says no."""

    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if not allowed(request.method, request.path, request.headers.get("Authorization"), api_key):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check
