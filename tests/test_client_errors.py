"""Client behaviour: server down, retries on 5xx, no retry on 4xx / weight calls, timeouts."""
import asyncio
import time

import pytest
from aiohttp import web

from megarl.rollout.client import RequestFailed, ServerDown, SGLangClient, sampling_params
from tests.helpers.servers import free_port
from tests.helpers.http import serve


def test_server_down_is_a_clear_error():
    port = free_port()

    async def main():
        async with SGLangClient(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.01) as c:
            assert await c.health() is False
            with pytest.raises(ServerDown) as e:
                await c.generate([1, 2], sampling_params(max_new_tokens=2))
            return str(e.value)
    msg = asyncio.run(main())
    assert f"127.0.0.1:{port}" in msg and "unreachable after 3 attempt" in msg


def test_retries_5xx_then_succeeds_and_4xx_not_retried():
    calls = {"n": 0, "w": 0}

    async def handler(request):
        if request.path == "/generate":
            calls["n"] += 1
            if calls["n"] < 3:
                return web.Response(status=503, text="busy")
            return web.json_response({"output_ids": [1], "meta_info": {"finish_reason": {"type": "length"}}})
        calls["w"] += 1
        return web.json_response({"success": False, "message": "bad"}, status=500)

    async def main():
        runner, port = await serve(handler)
        async with SGLangClient(f"http://127.0.0.1:{port}", retries=3, backoff_s=0.01) as c:
            out = await c.generate([1], sampling_params(max_new_tokens=1))
            with pytest.raises(RequestFailed) as e:
                await c.update_weights_from_disk("/x")
        await runner.cleanup()
        return out, e.value
    out, err = asyncio.run(main())
    assert out[0].output_ids == [1] and calls["n"] == 3
    assert calls["w"] == 1 and err.status == 500  # weight calls are never retried


def test_timeout_raises_server_down():
    """A server that never answers (until the test releases it): the client gives up after its
    timeout on each attempt and raises ServerDown, instead of waiting for the server."""
    async def handler(request):
        await release.wait()
        return web.json_response({})

    async def main():
        runner, port = await serve(handler)
        async with SGLangClient(f"http://127.0.0.1:{port}", timeout_s=0.3, retries=1, backoff_s=0.01) as c:
            t = time.time()
            with pytest.raises(ServerDown):
                await asyncio.wait_for(c.get_model_info(), 300)   # a hang guard
            dt = time.time() - t
        release.set()
        await runner.cleanup()
        return dt
    release = asyncio.Event()
    assert asyncio.run(main()) >= 0.3 * 2   # both attempts waited out their timeout


def test_bounded_concurrency():
    state = {"now": 0, "peak": 0}

    async def handler(request):
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        await asyncio.sleep(0.05)
        state["now"] -= 1
        return web.json_response({"output_ids": [1], "meta_info": {"finish_reason": {"type": "length"}}})

    async def main():
        runner, port = await serve(handler)
        async with SGLangClient(f"http://127.0.0.1:{port}", max_concurrency=3) as c:
            await asyncio.gather(*[c.generate([1]) for _ in range(12)])
        await runner.cleanup()
    asyncio.run(main())
    assert state["peak"] == 3
