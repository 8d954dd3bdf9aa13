"""A throwaway aiohttp server on a free loopback port, answering every path with ``handler``."""
from __future__ import annotations

from aiohttp import web


async def serve(handler) -> tuple[web.AppRunner, int]:
    """Start it; returns (runner to ``cleanup()``, port)."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]
