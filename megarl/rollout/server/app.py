"""aiohttp app exposing the SGLang native API subset over the engine.

Status codes follow sglang's http_server.py: weight endpoints answer
`{"success": bool, "message": str}` with 200 / 400; `/health` is 200 only once the model is
loaded (503 before); `/flush_cache` answers plain text.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from typing import Any, Dict, List, Optional

from aiohttp import web

from ..protocol import CHECKSUM_FIELD, OUTPUT_TOKEN_LOGPROBS  # noqa: F401
from .engine import Engine, Request, Sampling
from .weights import WeightReceiver, WeightRefused

log = logging.getLogger("megarl.rollout.server")


class ServerState:
    def __init__(self, model_path: str, served_model_name: Optional[str] = None):
        self.model_path = model_path
        self.served_model_name = served_model_name or model_path
        self.engine: Optional[Engine] = None
        self.receiver: Optional[WeightReceiver] = None
        self.tokenizer = None
        self.ready = False
        self.load_error: Optional[str] = None
        # SGLang 0.5.23: distributed/tensor updates only inside begin_weight_update..end_weight_update
        self.update_session_open = False


def _json_error(status: int, msg: str) -> web.Response:
    return web.json_response({"error": {"message": msg, "code": status}}, status=status)


async def _body(request: web.Request) -> Dict[str, Any]:
    if request.can_read_body:
        try:
            d = await request.json()
        except Exception as e:
            raise web.HTTPBadRequest(text=f"invalid JSON: {e}")
        if d is None:
            return {}
        if not isinstance(d, dict):
            raise web.HTTPBadRequest(text="request body must be a JSON object")
        return d
    return {}


def build_app(state: ServerState) -> web.Application:
    app = web.Application(client_max_size=1 << 30)
    routes = web.RouteTableDef()

    def engine() -> Engine:
        if not state.ready or state.engine is None:
            raise web.HTTPServiceUnavailable(text=state.load_error or "model is loading")
        return state.engine

    @routes.get("/health")
    @routes.get("/health_generate")
    async def health(request):
        if state.ready:
            return web.Response(status=200)
        return web.Response(status=503, text=state.load_error or "loading")

    @routes.get("/get_model_info")
    @routes.get("/model_info")
    async def model_info(request):
        eng = engine()
        spec = eng.model.spec
        return web.json_response({
            "model_path": state.model_path,
            "served_model_name": state.served_model_name,
            "tokenizer_path": state.model_path if state.tokenizer is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": eng.weight_version,
            "model_type": spec.model_type,
            "architectures": getattr(eng.model.cfg, "architectures", None),
            # megarl extras
            "megarl_engine": "embedded",
            "megarl_num_weight_updates": state.receiver.num_updates,
            "megarl_stats": dict(eng.stats),
        })

    @routes.get("/get_server_info")
    @routes.get("/server_info")
    async def server_info(request):
        eng = engine()
        return web.json_response({"model_path": state.model_path, "tp_size": 1, "max_running_requests": eng.max_running,
                                  "context_length": eng.max_len, "device": str(eng.model.device),
                                  "megarl_stats": dict(eng.stats), "version": "megarl-embedded"})

    @routes.route("*", "/generate")
    async def generate(request):
        eng = engine()
        body = await _body(request)
        if body.get("stream"):
            return _json_error(400, "stream=True is not supported by the embedded server")
        ids = body.get("input_ids")
        if ids is None and body.get("text") is not None:
            if state.tokenizer is None:
                return _json_error(400, "this server has no tokenizer: send input_ids")
            texts = body["text"]
            ids = ([state.tokenizer.encode(t) for t in texts] if isinstance(texts, list)
                   else state.tokenizer.encode(texts))
        if ids is None or (isinstance(ids, list) and len(ids) == 0):
            return _json_error(400, "input_ids (or text) is required")
        batched = isinstance(ids[0], list)
        prompts: List[List[int]] = ids if batched else [ids]
        sp = body.get("sampling_params") or {}
        sps = sp if isinstance(sp, list) else [sp] * len(prompts)
        rl = body.get("return_logprob") or False
        rls = rl if isinstance(rl, list) else [rl] * len(prompts)
        rid = body.get("rid")
        try:
            reqs: List[Request] = []
            for i, (p, s, r) in enumerate(zip(prompts, sps, rls)):
                samp = Sampling.from_dict(s)
                n = int((s or {}).get("n", 1) or 1)
                for j in range(n):
                    base = rid[i] if isinstance(rid, list) else (rid or uuid.uuid4().hex)
                    sub = f"{base}" if (n == 1 and not batched) else f"{base}-{i}-{j}"
                    reqs.append(Request(input_ids=[int(t) for t in p], sampling=samp, return_logprob=bool(r), rid=sub))
            if any(len(q.input_ids) + q.sampling.max_new_tokens > eng.max_len for q in reqs):
                pass  # generation stops at context length with finish_reason length
            futs = []
            for q in reqs:
                if q.sampling.max_new_tokens == 0:
                    q.finish_reason = {"type": "length", "length": 0}
                    f = asyncio.get_running_loop().create_future()
                    f.set_result(q.result(eng.weight_version))
                    futs.append(f)
                else:
                    futs.append(asyncio.wrap_future(eng.submit(q)))
        except (ValueError, RuntimeError) as e:
            return _json_error(400, str(e))
        try:
            outs = await asyncio.gather(*futs)
        except Exception as e:
            return _json_error(500, f"generation failed: {e}")
        if state.tokenizer is not None:
            for o in outs:
                o["text"] = state.tokenizer.decode(o["output_ids"], skip_special_tokens=True)
        if len(outs) == 1 and not batched:
            return web.json_response(outs[0])
        return web.json_response(outs)

    executors: Dict[str, concurrent.futures.ThreadPoolExecutor] = {}

    def _executor(group: str) -> concurrent.futures.ThreadPoolExecutor:
        # one thread per weight-update group: a group's ops run in arrival order; different
        # groups (trainer senders) proceed concurrently.
        if group not in executors:
            executors[group] = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"weights-{group}")
        return executors[group]

    async def _weights_op(group: str, fn, *args, apply: bool = True):
        """Receive + verify on the group's thread, then (if `apply`) swap in on the engine thread."""
        eng = engine()
        loop = asyncio.get_running_loop()
        timings: Dict[str, float] = {}
        try:
            res = await loop.run_in_executor(_executor(group), lambda: fn(*args))
            if apply:
                pairs, msg, received = res
                timings.update(received)
                t_post = time.perf_counter()

                def _apply():
                    t = time.perf_counter()
                    state.receiver.apply(pairs)
                    return t - t_post, time.perf_counter() - t
                # handoff_s: waiting for the engine thread (immediate when idle, one step when decoding)
                timings["handoff_s"], timings["apply_s"] = await asyncio.wrap_future(eng.control(_apply))
            else:
                msg = res
        except WeightRefused as e:
            log.warning("weight update refused: %s", e)
            return web.json_response({"success": False, "message": f"refused, old weights kept: {e}"}, status=400)
        except Exception as e:
            log.exception("weight op failed")
            return web.json_response({"success": False, "message": f"{type(e).__name__}: {e}"}, status=400)
        body = {"success": True, "message": msg}
        if timings:
            body["megarl_timings"] = timings   # megarl extension: seconds per phase of this update
        return web.json_response(body)

    def _session_refusal(endpoint: str) -> Optional[web.Response]:
        """SGLang's answer to an update outside a session (given before any broadcast is joined)."""
        if state.update_session_open:
            return None
        return web.json_response({"success": False, "message": f"{endpoint} must run between "
                                  "begin_weight_update() and end_weight_update()"}, status=400)

    @routes.post("/begin_weight_update")
    async def begin_weight_update(request):
        engine()
        await _body(request)
        if state.update_session_open:
            return web.json_response({"success": False, "message": "a weight-update session is already open; "
                                      "call end_weight_update() first"}, status=400)
        state.update_session_open = True
        return web.json_response({"success": True, "message": "Success"})

    @routes.post("/end_weight_update")
    async def end_weight_update(request):
        engine()
        await _body(request)
        if not state.update_session_open:
            return web.json_response({"success": False, "message": "no weight-update session is open; "
                                      "call begin_weight_update() first"}, status=400)
        state.update_session_open = False
        return web.json_response({"success": True, "message": "Success"})

    @routes.post("/init_weights_update_group")
    async def init_group(request):
        b = await _body(request)
        try:
            args = (b["master_address"], int(b["master_port"]), int(b["rank_offset"]), int(b["world_size"]),
                    b.get("group_name", "weight_update_group"), b.get("backend", "nccl"))
        except KeyError as e:
            return web.json_response({"success": False, "message": f"missing field {e}"}, status=400)
        # Rendezvous blocks until the trainer joins: it runs on the group's thread, so the event
        # loop keeps serving /health and the engine keeps decoding.
        return await _weights_op(args[4], state.receiver.init_group, *args, apply=False)

    @routes.post("/destroy_weights_update_group")
    async def destroy_group(request):
        b = await _body(request)
        g = b.get("group_name", "weight_update_group")
        return await _weights_op(g, state.receiver.destroy_group, g, apply=False)

    def _bump_version(b):
        if b.get("weight_version") is not None:
            state.engine.weight_version = str(b["weight_version"])

    @routes.post("/update_weights_from_distributed")
    async def upd_dist(request):
        b = await _body(request)
        for k in ("names", "dtypes", "shapes"):
            if k not in b:
                return web.json_response({"success": False, "message": f"missing field {k}"}, status=400)
        refused = _session_refusal("update_weights_from_distributed")
        if refused is not None:
            return refused
        resp = await _weights_op(b.get("group_name", "weight_update_group"), state.receiver.from_distributed, b["names"], b["dtypes"], b["shapes"],
                                 b.get("group_name", "weight_update_group"), b.get("load_format"),
                                 b.get(CHECKSUM_FIELD))
        if resp.status == 200:
            _bump_version(b)
        return resp

    @routes.post("/update_weights_from_tensor")
    async def upd_tensor(request):
        b = await _body(request)
        if "serialized_named_tensors" not in b:
            return web.json_response({"success": False, "message": "missing field serialized_named_tensors"}, status=400)
        refused = _session_refusal("update_weights_from_tensor")
        if refused is not None:
            return refused
        resp = await _weights_op("__tensor__", state.receiver.from_tensor, b["serialized_named_tensors"], b.get("load_format"),
                                 b.get(CHECKSUM_FIELD))
        if resp.status == 200:
            _bump_version(b)
        return resp

    @routes.post("/update_weights_from_disk")
    async def upd_disk(request):
        b = await _body(request)
        if "model_path" not in b:
            return web.json_response({"success": False, "message": "missing field model_path"}, status=400)
        resp = await _weights_op("__disk__", state.receiver.from_disk, b["model_path"])
        if resp.status == 200:
            _bump_version(b)
        data = {"success": resp.status == 200, "message": _msg(resp), "num_paused_requests": 0}
        return web.json_response(data, status=resp.status)

    @routes.route("*", "/flush_cache")
    async def flush_cache(request):
        engine()
        return web.Response(text="Cache flushed.\n")

    @routes.route("*", "/release_memory_occupation")
    async def release(request):
        eng = engine()
        b = await _body(request)
        tags = b.get("tags") or ["weights", "kv_cache"]

        def op():
            if eng.running or eng.waiting.qsize():
                raise RuntimeError("requests in flight; release memory when idle")
            if "kv_cache" in tags:
                eng.model.free_cache()
            if "weights" in tags and eng.model.device.type == "cuda":
                for k, t in eng.model.params.items():
                    eng.model.params[k] = t.to("cpu", non_blocking=False)
            eng.released.update(tags)
            return "released " + ",".join(tags)
        try:
            await asyncio.wrap_future(eng.control(op))
        except Exception as e:
            return _json_error(400, str(e))
        return web.Response(status=200)

    @routes.route("*", "/resume_memory_occupation")
    async def resume(request):
        eng = engine()
        b = await _body(request)
        tags = b.get("tags") or ["weights", "kv_cache"]

        def op():
            if "weights" in tags and "weights" in eng.released:
                for k, t in eng.model.params.items():
                    eng.model.params[k] = t.to(eng.model.device)
            if "kv_cache" in tags and "kv_cache" in eng.released:
                eng.model.alloc_cache(eng.max_running, eng.max_len)
            eng.released.difference_update(tags)
            return "resumed"
        await asyncio.wrap_future(eng.control(op))
        return web.Response(status=200)

    app.add_routes(routes)
    app["state"] = state
    return app


def _msg(resp: web.Response) -> str:
    import json
    try:
        return json.loads(resp.body)["message"]
    except Exception:
        return ""
