"""What a rollout server's engine holds, read from the server (for tests that must act while a
request is generating: they wait for the server to say so instead of sleeping a guessed delay).

Both servers answer from ``Engine.requests`` (``running``: rid -> output tokens so far, a running
request having been prefilled with its first token out; ``queued``: rids): megarl's embedded server
in ``/server_info``'s ``megarl_requests``, SGLang's own server code (tests/sglang_cpu) in
``/server_info``'s ``internal_states`` (its scheduler's answer to SGLang's ``GetInternalStateReq``).
"""
from __future__ import annotations

import asyncio
from typing import Iterable, Optional

import aiohttp

HANG_S = 300   # a hang guard, far above any expected wait


async def held(url: str, api_key: Optional[str] = None) -> dict:
    """``{"running": {rid: tokens}, "queued": [rid]}`` of the server at ``url``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(headers=headers) as s:
        async with s.get(url + "/server_info") as r:
            r.raise_for_status()
            body = await r.json(content_type=None)
    return body["megarl_requests"] if "megarl_requests" in body else body["internal_states"][0]["megarl_requests"]


async def until_generating(url: str, *rids: str, api_key: Optional[str] = None,
                           tasks: Iterable[asyncio.Future] = (), past: int = 0) -> dict:
    """Wait until the server runs every rid with more than ``past`` tokens out; returns what it
    holds then. Returns at once when one of ``tasks`` (the requests' own futures) has ended (the
    caller's checks then say it finished too early); fails after HANG_S."""
    tasks = list(tasks)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HANG_S
    while True:
        state = await held(url, api_key)
        if all(state["running"].get(r, 0) > past for r in rids) or any(t.done() for t in tasks):
            return state
        assert loop.time() < deadline, f"{rids} not generating after {HANG_S} s: {state}"
        await asyncio.sleep(0.005)
