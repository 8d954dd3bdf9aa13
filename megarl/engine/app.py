"""aiohttp app exposing the SGLang native API subset over the engine (TP rank 0 only).

Status codes and bodies follow sglang 0.5.23's http_server.py: weight endpoints answer
`{"success": bool, "message": str}` with 200 / 400 (`/update_weights_from_disk` adds
`num_paused_requests`); `/health` is 200 only once the model is loaded (503 before);
`/flush_cache` answers plain text; with an API key, every path but /health*, /ready*, /metrics*
answers 401 `{"error": "Unauthorized"}` without `Authorization: Bearer <key>` (`auth.py`).

Weight updates (`session.py`): `/update_weights_from_distributed` and `/update_weights_from_tensor`
only inside a `/begin_weight_update` ... `/end_weight_update` session; the distributed request is
checked (session, fields, layout, group) BEFORE any rank joins the broadcast, so a refusal is
answered while the trainer is still free to abort. Weight ops are serialised (one at a time, as
SGLang's model-update writer lock does) and run on the engine thread between decode steps, on
every TP rank (`worker.ModelHandle`).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Dict, List, Optional

from aiohttp import web

from .auth import api_key_middleware
from .engine import Engine, EngineStopped, Request, Sampling
from .input_logprobs import logprob_start, score_inputs
from .pause import PAUSE_MODES, GenerationGate, ServerClosing
from .session import SessionError, SessionGate, applies_to_target, check_selector
from .tp import RankFailure
from .weights import receive_layout, resolve_disk_path
from .worker import ModelHandle, RankWorker

log = logging.getLogger("megarl.engine")


class ServerState:
    def __init__(self, model_path: str, served_model_name: Optional[str] = None, tp_size: int = 1,
                 weights_dir: Optional[str] = None, enable_lora: bool = False, weights_cpu_backup: bool = False):
        self.model_path = model_path
        self.served_model_name = served_model_name or model_path
        self.tp_size = tp_size
        self.weights_dir = weights_dir
        self.enable_lora = enable_lora     # --enable-lora: the LoRA endpoints and lora_path (SGLang's flag)
        self.weights_cpu_backup = weights_cpu_backup   # --enable-weights-cpu-backup: released weights kept
        self.engine: Optional[Engine] = None
        self.handle: Optional[ModelHandle] = None
        self.worker: Optional[RankWorker] = None     # rank 0's own worker (its groups, counters)
        self.tokenizer = None
        self.ready = False
        self.load_error: Optional[str] = None
        self.gate = SessionGate()
        self.generation = GenerationGate()   # SGLang's pause flag + model-update lock


def _json_error(status: int, msg: str) -> web.Response:
    return web.json_response({"error": {"message": msg, "code": status}}, status=status)


def _result(success: bool, message: str, **extra: Any) -> web.Response:
    return web.json_response({"success": success, "message": message, **extra}, status=200 if success else 400)


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


def build_app(state: ServerState, api_key: Optional[str] = None) -> web.Application:
    app = web.Application(client_max_size=1 << 30, middlewares=[api_key_middleware(api_key)])
    routes = web.RouteTableDef()
    weights_lock = asyncio.Lock()     # one weight op / session change at a time

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
            "megarl_tp_size": state.tp_size,
            "megarl_num_weight_updates": state.worker.receiver.num_updates,
            "megarl_weight_sessions": state.gate.opened,
            "megarl_lora_adapters": sorted(eng.loras),   # names /generate may give as lora_path
            # cpu_s: this process, all threads; graph_captures: decode CUDA graphs captured so far on
            # rank 0 (replayed across releases when the weights and cache keep their addresses)
            "megarl_stats": dict(eng.stats, cpu_s=time.process_time(),
                                 graph_captures=getattr(state.worker.model.graphs, "captures", 0)),
        })

    @routes.get("/get_server_info")
    @routes.get("/server_info")
    async def server_info(request):
        eng = engine()
        held = await asyncio.wrap_future(eng.control(eng.requests, new_epoch=False))
        return web.json_response({"model_path": state.model_path, "tp_size": state.tp_size,
                                  "max_running_requests": eng.max_running, "context_length": eng.max_len,
                                  "device": str(eng.model.device), "megarl_stats": dict(eng.stats),
                                  "megarl_requests": held, "version": "megarl-embedded"})

    @routes.route("*", "/generate")
    async def generate(request):
        eng = engine()
        body = await _body(request)
        try:
            async with state.generation.generating():   # waits out a pause; holds off weight updates
                return await _generate(eng, body)
        except ServerClosing as e:
            return _json_error(503, str(e))

    async def _generate(eng: Engine, body: Dict[str, Any]) -> web.Response:
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
        ls = body.get("logprob_start_len")
        starts = ls if isinstance(ls, list) else [ls] * len(prompts)
        if len(starts) != len(prompts):
            return _json_error(400, "logprob_start_len: one start, or a list of one per prompt")
        rid = body.get("rid")
        lora = body.get("lora_path")
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        if lora is not None and not state.enable_lora:   # SGLang's tokenizer manager refuses the same way
            return _json_error(400, f"lora_path: LoRA adapter {loras[0]!r} was requested, but LoRA is not enabled "
                                    "(start the server with --enable-lora)")
        if len(loras) != len(prompts) or not all(x is None or isinstance(x, str) for x in loras):
            return _json_error(400, "lora_path: an adapter name, or a list of one name (or null) per prompt")
        routes = bool(body.get("return_routed_experts") or False)
        routes_start = body.get("routed_experts_start_len") or 0
        try:
            reqs: List[Request] = []
            ns = {int((s or {}).get("n", 1) or 1) for s in sps}
            if len(ns) > 1:   # SGLang: "The parallel_sample_num should be the same for all samples"
                raise ValueError("n must be the same for every item of a batch")
            for i, (p, s, r, ad, st) in enumerate(zip(prompts, sps, rls, loras, starts)):
                samp = Sampling.from_dict(s)
                start = logprob_start(st, bool(r), len(p))
                if routes and not 0 <= int(routes_start) <= len(p):
                    # SGLang's scheduler aborts such a request with this reason
                    raise ValueError(f"routed_experts_start_len={routes_start} must be in [0, number of input "
                                     f"tokens {len(p)}]")
                n = int((s or {}).get("n", 1) or 1)
                ids_i = [int(t) for t in p]
                for j in range(n):   # prompt-major, as SGLang answers n > 1
                    base = rid[i] if isinstance(rid, list) else (rid or uuid.uuid4().hex)
                    sub = f"{base}" if (n == 1 and not batched) else f"{base}-{i}-{j}"
                    reqs.append(Request(input_ids=ids_i, sampling=samp.for_sample(j), return_logprob=bool(r), rid=sub,
                                        return_routed_experts=routes, routed_experts_start_len=int(routes_start),
                                        lora=ad, logprob_start_len=start))
            if any(q.logprob_start_len >= 0 for q in reqs):   # input logprobs: scored between decode steps
                await asyncio.wrap_future(eng.control(lambda: score_inputs(state.handle, reqs), new_epoch=False))
            loop = asyncio.get_running_loop()
            futs: List[Any] = [None] * len(reqs)
            todo = []
            for k, q in enumerate(reqs):
                if q.sampling.max_new_tokens == 0:
                    q.finish_reason = {"type": "length", "length": 0}
                    futs[k] = loop.create_future()
                    futs[k].set_result(q.result(eng.weight_version))
                else:
                    todo.append(k)
            for k, f in zip(todo, eng.submit_many([reqs[k] for k in todo])):
                futs[k] = asyncio.wrap_future(f)
        except EngineStopped as e:
            return _json_error(503, str(e))
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

    # ------------------------------------------------------------------ weights
    async def _on_ranks(op: str, *args: Any, after: Optional[Any] = None) -> Any:
        """Run weight op `op` on every TP rank (engine thread, between steps), then `after()` on the
        engine thread too (no decode step between them). Returns its result; a (message, timings)
        result gets `handoff_s` (the wait for the engine thread)."""
        eng = engine()
        t_submit = time.perf_counter()

        def run():
            t_start = time.perf_counter()
            res = state.handle.weights(op, *args)
            if after is not None:
                after()
            if isinstance(res, tuple):
                msg, timings = res
                return msg, dict(timings, handoff_s=t_start - t_submit)
            return res
        return await asyncio.wrap_future(eng.control(run))

    async def _update(op: str, args: tuple, body: Dict[str, Any], extra: Optional[dict] = None) -> web.Response:
        """Dispatch an update already checked on rank 0; map the outcome to SGLang's answer: the
        new `weight_version` is recorded on the engine thread right after the load (so the version
        spans of live requests switch exactly there), and with `flush_cache` (SGLang's default) an
        update that finds requests running -- or queued, unless paused -- reports the flush
        failure SGLang reports (the weights are updated all the same)."""
        extra = extra or {}
        eng = engine()
        if body.get("abort_all_requests"):
            await asyncio.wrap_future(eng.control(lambda: eng.abort(abort_all=True)))
        version = body.get("weight_version")
        flushed: Dict[str, bool] = {}

        def after() -> None:
            if version is not None:
                eng.set_weight_version(str(version))
            flushed["ok"] = eng.idle(ignore_waiting=state.generation.paused)
        try:
            msg, timings = await _on_ranks(op, *args, after=after)
        except RankFailure as e:
            return _result(False, str(e), **extra)
        except Exception as e:  # noqa: BLE001 - an unexpected failure: report it, do not crash the server
            log.exception("weight op %s failed", op)
            return _result(False, f"{type(e).__name__}: {e}", **extra)
        state.gate.loaded()
        if body.get("flush_cache", True) and not flushed.get("ok", True):
            return _result(False, "Weights were updated, but the cache was not flushed because requests are still "
                                  "running or queued. Retract or finish them, then call /flush_cache.", **extra)
        if version is not None:
            msg += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": msg, **extra,
                                  "megarl_timings": timings})   # megarl extension: seconds per phase

    @routes.post("/begin_weight_update")
    async def begin(request):
        engine()
        b = await _body(request)
        async with state.generation.updating(), weights_lock:
            try:
                return _result(True, state.gate.begin(b.get("selector")))
            except SessionError as e:
                return _result(False, str(e))

    @routes.post("/end_weight_update")
    async def end(request):
        engine()
        await _body(request)
        async with state.generation.updating(), weights_lock:
            try:
                return _result(True, state.gate.end())
            except SessionError as e:
                return _result(False, str(e))

    @routes.post("/init_weights_update_group")
    async def init_group(request):
        engine()
        b = await _body(request)
        try:
            args = (str(b["master_address"]), int(b["master_port"]), int(b["rank_offset"]), int(b["world_size"]),
                    str(b.get("group_name", "weight_update_group")), str(b.get("backend", "nccl")))
        except KeyError as e:
            return _result(False, f"missing field {e}")
        except (TypeError, ValueError) as e:
            return _result(False, f"invalid field: {e}")
        # The rendezvous blocks until the trainer joins (it does so right after posting this).
        try:
            return _result(True, await _on_ranks("init_group", *args))
        except RankFailure as e:
            return _result(False, str(e))

    @routes.post("/destroy_weights_update_group")
    async def destroy_group(request):
        engine()
        b = await _body(request)
        try:
            return _result(True, await _on_ranks("destroy_group", str(b.get("group_name", "weight_update_group"))))
        except RankFailure as e:
            return _result(False, str(e))

    @routes.post("/update_weights_from_distributed")
    async def upd_dist(request):
        engine()
        b = await _body(request)
        async with state.generation.updating(), weights_lock:
            # every check that can refuse happens before any rank joins the broadcast: here, and
            # for the group on each rank before its receive (`WeightReceiver.from_distributed`)
            try:
                state.gate.require("update_weights_from_distributed")
                for k in ("names", "dtypes", "shapes"):
                    if k not in b:
                        raise ValueError(f"missing field {k}")
                selector = check_selector(b.get("selector"))
                group = str(b.get("group_name", "weight_update_group"))
                receive_layout(b["names"], b["dtypes"], b["shapes"])
                # (the group is checked on the engine thread, in arrival order after its init)
            except SessionError as e:
                return _result(False, str(e))
            except (ValueError, TypeError) as e:
                return _result(False, f"Failed to receive weights: {e}")
            load = applies_to_target(selector)
            args = (b["names"], b["dtypes"], b["shapes"], group, b.get("load_format"), b.get("megarl_checksums"), load)
            return await _update("update_from_distributed", args, b)

    @routes.post("/update_weights_from_tensor")
    async def upd_tensor(request):
        engine()
        b = await _body(request)
        async with state.generation.updating(), weights_lock:
            try:
                state.gate.require("update_weights_from_tensor")
                payloads = b.get("serialized_named_tensors")
                if not isinstance(payloads, list):
                    raise ValueError("missing field serialized_named_tensors (a list, one payload per TP rank)")
                if len(payloads) < state.tp_size:
                    raise ValueError(f"serialized_named_tensors has {len(payloads)} payload(s) but this server has "
                                     f"{state.tp_size} TP ranks: send one per TP rank (rank r reads entry r)")
                selector = check_selector(b.get("selector"))
            except SessionError as e:
                return _result(False, str(e))
            except ValueError as e:
                return _result(False, str(e))
            load = applies_to_target(selector)
            args = (payloads, b.get("load_format"), b.get("megarl_checksums"), load)
            return await _update("update_from_tensor", args, b)

    @routes.post("/update_weights_from_disk")
    async def upd_disk(request):
        engine()
        b = await _body(request)
        async with state.generation.updating(), weights_lock:
            if "model_path" not in b:
                return _result(False, "missing field model_path", num_paused_requests=0)
            try:
                path = resolve_disk_path(str(b["model_path"]), state.weights_dir)
            except ValueError as e:
                return _result(False, str(e), num_paused_requests=0)
            return await _update("update_from_disk", (path,), b, {"num_paused_requests": 0})

    # ------------------------------------------------------------------ LoRA adapters (lora.py)
    def _lora_result(success: bool, message: str) -> web.Response:
        """SGLang's ``LoRAUpdateOutput``: 200 / 400 with success, error_message, loaded_adapters."""
        eng = state.engine
        loaded = {n: n for n in sorted(eng.loras)} if eng is not None else {}
        return web.json_response({"success": success, "error_message": None if success else message,
                                  "loaded_adapters": loaded}, status=200 if success else 400)

    async def _load_lora(b: Dict[str, Any], source_of) -> web.Response:
        eng = engine()
        if not state.enable_lora:
            return _lora_result(False, "LoRA is not enabled on this server (start it with --enable-lora)")
        name = b.get("lora_name")
        if not isinstance(name, str) or not name:
            return _lora_result(False, "lora_name: a non-empty adapter name is required")
        async with weights_lock:
            if name in eng.loras:
                return _lora_result(False, f"lora_name: an adapter named {name!r} is already loaded")
            try:
                args = source_of(b)
            except ValueError as e:
                return _lora_result(False, str(e))

            def run() -> str:
                msg = state.handle.weights("load_lora", name, *args)
                eng.loras.add(name)
                return msg
            try:
                await asyncio.wrap_future(eng.control(run))
            except RankFailure as e:
                return _lora_result(False, str(e))
            except Exception as e:  # noqa: BLE001 - report it, do not crash the server
                log.exception("LoRA load failed")
                return _lora_result(False, f"{type(e).__name__}: {e}")
        return _lora_result(True, "")

    def _tensor_source(b: Dict[str, Any]) -> tuple:
        payloads = b.get("serialized_named_tensors")
        if not isinstance(payloads, list) or len(payloads) < state.tp_size:
            raise ValueError(f"serialized_named_tensors: one payload per TP rank is required ({state.tp_size})")
        if b.get("load_format") not in (None, "auto"):
            raise ValueError(f"load_format: only the default {{name: tensor}} payload is served, got {b['load_format']!r}")
        if not isinstance(b.get("config_dict"), dict):
            raise ValueError("config_dict: the PEFT adapter_config object is required")
        return b["config_dict"], payloads, b.get("expected_checksums")

    def _disk_source(b: Dict[str, Any]) -> tuple:
        if not isinstance(b.get("lora_path"), str):
            raise ValueError("lora_path: a PEFT adapter folder is required")
        return None, resolve_disk_path(b["lora_path"], state.weights_dir, "lora_path", "load_lora_adapter"), None

    @routes.post("/load_lora_adapter_from_tensors")
    async def load_lora_from_tensors(request):
        return await _load_lora(await _body(request), _tensor_source)

    @routes.post("/load_lora_adapter")
    async def load_lora_from_disk(request):
        return await _load_lora(await _body(request), _disk_source)

    @routes.post("/unload_lora_adapter")
    async def unload_lora(request):
        eng = engine()
        b = await _body(request)
        if not state.enable_lora:
            return _lora_result(False, "LoRA is not enabled on this server (start it with --enable-lora)")
        name = b.get("lora_name")
        async with weights_lock:
            if not await asyncio.wrap_future(eng.control(lambda: eng.unload_lora(str(name)), new_epoch=False)):
                return _lora_result(False, f"lora_name: no adapter named {name!r} is loaded")
        return _lora_result(True, "")

    @routes.post("/update_weight_version")
    async def update_weight_version(request):
        """SGLang's route: names the served version without touching weights (adapter-only pushes);
        requests in flight record the change in their version spans, as with a weight update."""
        eng = engine()
        b = await _body(request)
        if not isinstance(b.get("new_version"), str):
            return _result(False, "new_version: a version string is required")
        if b.get("abort_all_requests", True):
            await asyncio.wrap_future(eng.control(lambda: eng.abort(abort_all=True), new_epoch=False))
        await asyncio.wrap_future(eng.control(lambda: eng.set_weight_version(b["new_version"]), new_epoch=False))
        return web.json_response({"success": True, "message": f"Weight version updated to {b['new_version']}",
                                  "new_version": b["new_version"]})

    # ------------------------------------------------------------------ pause / continue / abort
    @routes.post("/pause_generation")
    async def pause_generation(request):
        eng = engine()
        b = await _body(request)
        mode = b.get("mode", "abort")
        if mode not in PAUSE_MODES:   # SGLang's Literal field: FastAPI answers 422
            return web.json_response({"detail": [{"loc": ["body", "mode"], "msg": f"Input should be "
                                                  f"{' or '.join(repr(m) for m in PAUSE_MODES)}", "input": mode}]},
                                     status=422)

        async def abort_all() -> None:
            await asyncio.wrap_future(eng.control(lambda: eng.abort(abort_all=True)))

        async def pause_engine(m: str) -> None:
            await asyncio.wrap_future(eng.control(lambda: eng.pause(m)))
        await state.generation.pause(mode, abort_all, pause_engine)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    @routes.post("/continue_generation")
    async def continue_generation(request):
        eng = engine()
        b = await _body(request)

        def op() -> None:
            if b.get("torch_empty_cache", True) and eng.model.device.type == "cuda":
                import torch

                torch.cuda.empty_cache()
            eng.unpause()

        async def resume_engine() -> None:
            await asyncio.wrap_future(eng.control(op))
        await state.generation.resume(resume_engine)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    @routes.post("/abort_request")
    async def abort_request(request):
        eng = engine()
        b = await _body(request)
        rid, abort_all = str(b.get("rid") or ""), bool(b.get("abort_all", False))

        def op() -> int:
            # SGLang's tokenizer manager forwards only a rid it holds (exact match), the scheduler then
            # aborts every request whose rid starts with it; an empty rid without abort_all is ignored
            if not abort_all and not eng.has_request(rid):
                return 0
            return eng.abort(rid, abort_all)
        await asyncio.wrap_future(eng.control(op))
        return web.Response(status=200)

    # ------------------------------------------------------------------ cache / memory
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
            if "weights" in tags:   # (on CPU too: the same contract, host memory either way)
                eng.model.offload_weights(state.weights_cpu_backup)
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
                eng.model.reload_weights()
            if "kv_cache" in tags and "kv_cache" in eng.released:
                eng.model.alloc_cache(eng.max_running, eng.max_len)
            eng.released.difference_update(tags)
            return "resumed"
        await asyncio.wrap_future(eng.control(op))
        return web.Response(status=200)

    app.add_routes(routes)
    app["state"] = state
    return app
