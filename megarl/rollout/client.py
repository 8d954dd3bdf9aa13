"""Async client for SGLang's native HTTP API (and the megarl embedded server, which speaks the same
subset).  Field names are sglang 0.5.23's (`megarl/wire/protocol.py`, checked against the
wheel by tests/test_client_fields.py).

Real SGLang launch that this client is tested to match (GPU box; see ARCHITECTURE.md, "Contracts with SGLang"):

    python -m sglang.launch_server --model-path /path/to/hf_model --host 127.0.0.1 --port 30000 \
        --tp-size 1 --mem-fraction-static 0.7 --skip-tokenizer-init --enable-memory-saver \
        --disable-radix-cache --random-seed 0

Embedded server (CPU / small GPU / CI):

    megarl serve /path/to/hf_model --port 30000        # == python -m megarl.engine ...

Retries: idempotent calls (generate, health, get_model_info, flush_cache, release/resume) are
retried on connection errors, timeouts and 5xx with exponential backoff; weight-update calls are
never retried (a half-done broadcast cannot be replayed) -- they raise.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import random
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

import aiohttp

from megarl.errors import UserError
from megarl.wire.protocol import CHECKSUM_FIELD, ENDPOINTS


class ServerError(RuntimeError):
    """Base of client errors; `.url` names the server."""

    def __init__(self, url: str, msg: str):
        super().__init__(f"{url}: {msg}")
        self.url = url


class ServerDown(ServerError, ConnectionError, UserError):
    """The server cannot be reached (refused, reset, DNS, timeout) after all retries (a user
    error: the message names the server, nothing in megarl's traceback would help)."""


class RequestFailed(ServerError):
    """The server answered with an error status (4xx, or 5xx after retries)."""

    def __init__(self, url: str, status: int, body: Any):
        super().__init__(url, f"HTTP {status}: {body}")
        self.status = status
        self.body = body

    @property
    def message(self) -> str:
        """The server's own words: SGLang/embedded `{"message": ...}` or `{"error": {"message"}}`."""
        body = self.body
        if isinstance(body, dict):
            err = body.get("error")
            if isinstance(err, dict) and err.get("message"):
                return str(err["message"])
            return str(body.get("message", err if err is not None else body))
        return str(body)


class Unauthorized(RequestFailed, UserError):
    """401/403: the server requires another API key (the one `rollout.api_key_env` names, sent as
    `Authorization: Bearer`). Raised at once, never retried."""

    def __init__(self, url: str, status: int, body: Any, key_sent: bool):
        super().__init__(url, status, body)
        hint = ("the API key sent was refused" if key_sent else "no API key was sent")
        self.args = (f"{url}: HTTP {status} unauthorized: {hint} (the variable rollout.api_key_env names, "
                     f"MEGARL_API_KEY by default, must hold the server's --api-key)",)


def sampling_params(max_new_tokens: int = 128, temperature: float = 1.0, top_p: float = 1.0,
                    top_k: int = -1, min_p: float = 0.0, stop_token_ids: Optional[Sequence[int]] = None,
                    n: int = 1, ignore_eos: bool = False, sampling_seed: Optional[int] = None,
                    **extra) -> Dict[str, Any]:
    """A `sampling_params` dict with sglang's SamplingParams field names."""
    d: Dict[str, Any] = {"max_new_tokens": int(max_new_tokens), "temperature": float(temperature),
                         "top_p": float(top_p), "top_k": int(top_k), "min_p": float(min_p), "n": int(n),
                         "ignore_eos": bool(ignore_eos)}
    if stop_token_ids:
        d["stop_token_ids"] = [int(t) for t in stop_token_ids]
    if sampling_seed is not None:
        d["sampling_seed"] = int(sampling_seed)
    d.update(extra)
    return d


def _weights_payload(payload: Dict[str, Any], load_format: Optional[str], weight_version: Optional[str],
                     checksums: Optional[List[str]]) -> Dict[str, Any]:
    """A weight-update request: sglang's optional fields only when set, plus megarl's checksums."""
    for key, value in (("load_format", load_format), ("weight_version", weight_version), (CHECKSUM_FIELD, checksums)):
        if value is not None:
            payload[key] = value
    return payload


@dataclass
class GenerateOutput:
    output_ids: List[int]
    logprobs: Optional[List[float]]       # rollout logprob of each output token (None if not asked)
    finish_reason: str                    # "stop" | "length" | "abort"
    matched: Optional[Any] = None         # stop token / string that ended it
    prompt_tokens: int = 0
    text: Optional[str] = None
    weight_version: Optional[str] = None
    meta_info: Dict[str, Any] = field(default_factory=dict)
    routed_experts: Optional[str] = None  # SGLang's base64 int32 [seqlen-1, layers, top_k] (routed_experts.py)

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "GenerateOutput":
        meta = d.get("meta_info", {}) or {}
        fr = meta.get("finish_reason") or {}
        otl = meta.get("output_token_logprobs")
        ids = d.get("output_ids")
        if ids is None and otl is not None:
            ids = [int(x[1]) for x in otl]
        return cls(output_ids=list(ids or []),
                   logprobs=[float(x[0]) for x in otl] if otl is not None else None,
                   finish_reason=fr.get("type", "unknown") if isinstance(fr, dict) else str(fr),
                   matched=fr.get("matched") if isinstance(fr, dict) else None,
                   prompt_tokens=int(meta.get("prompt_tokens", 0) or 0),
                   text=d.get("text"), weight_version=meta.get("weight_version"), meta_info=meta,
                   routed_experts=meta.get("routed_experts"))


class BadImage(UserError, ValueError):
    """An image given to `SGLangClient.generate_with_images` that does not decode (one line,
    naming the request and the image), raised before the request is sent."""


def image_data_url(image: Any, where: str = "image") -> str:
    """One image as a ``data:image/<format>;base64,`` URL (SGLang's ``load_image`` reads the
    bytes after the comma; a JSON body cannot carry raw bytes). Decoded with PIL first: an image
    the server could not open is refused here, where the message can name it."""
    import base64
    import binascii
    import io

    from PIL import Image, UnidentifiedImageError

    label = type(image).__name__
    try:
        if isinstance(image, (bytes, bytearray)):
            raw, label = bytes(image), f"<{len(image)} bytes>"
        elif isinstance(image, str):
            head, sep, body = image.partition(",")
            label = repr(image[:40] + ("..." if len(image) > 40 else ""))
            if not (sep and head.startswith("data:image/") and head.endswith(";base64")):
                raise ValueError("a string image must be a data:image/...;base64, URL")
            label = f"<data URL, {len(image)} chars>"     # not the payload itself
            raw = base64.b64decode(body, validate=True)
        elif getattr(image, "data", None) is not None:           # megarl.data.images.ImageRef with bytes
            raw, label = bytes(image.data), f"<{len(image.data)} bytes>"
        elif getattr(image, "path", None):                        # megarl.data.images.ImageRef with a file
            label = repr(image.path)
            with open(image.path, "rb") as f:
                raw = f.read()
        else:
            raise ValueError("an image must be an ImageRef, bytes or a data:image URL")
        with Image.open(io.BytesIO(raw)) as img:
            img.load()
            fmt = (img.format or "png").lower()
    except FileNotFoundError:
        raise BadImage(f"{where} {label}: no such file") from None
    except binascii.Error as err:
        raise BadImage(f"{where} {label} is not valid base64: {err}") from None
    except UnidentifiedImageError:
        raise BadImage(f"{where} {label} is not a decodable image: not an image format PIL reads") from None
    except (OSError, ValueError, SyntaxError) as err:
        detail = " ".join(str(err).split())
        raise BadImage(f"{where} {label} is not a decodable image: {type(err).__name__}: {detail}") from None
    return f"data:image/{fmt};base64," + base64.b64encode(raw).decode("ascii")


def _request_name(rid: Optional[str]) -> str:
    """How an error names a /generate request."""
    return f"generate request {rid!r}" if rid is not None else "generate request"


def image_data_field(images: Sequence[Any], n: int = 1, rid: Optional[str] = None) -> List[Any]:
    """SGLang's ``image_data`` for one prompt: its images as data URLs. With ``n == 1`` the
    request stays a single one and ``image_data`` is the flat list of its images; with ``n > 1``
    SGLang turns it into a batch of one prompt (``GenerateReqInput._handle_parallel_sampling``)
    whose ``image_data`` must hold one list per prompt (``_normalize_image_data``), so it is
    ``[images]``. The rid and input_ids stay as the text path sends them."""
    name = _request_name(rid)
    urls = [image_data_url(img, f"{name}: image {i}") for i, img in enumerate(images)]
    return urls if n <= 1 else [urls]


def collapse_image_runs(input_ids: Sequence[int], image_token_id: int) -> List[int]:
    """``input_ids`` with every run of ``image_token_id`` cut to one token: the form in which
    SGLang expands an image's placeholder itself and keeps every other id as given."""
    out: List[int] = []
    for t in input_ids:
        if not (t == image_token_id and out and out[-1] == image_token_id):
            out.append(int(t))
    return out


CONTROL_CONNECTIONS = 16   # connections beyond max_concurrency, for calls that are not /generate


class SGLangClient:
    """One server.  Use as `async with SGLangClient(url) as c: ...` (or call `close()`)."""

    def __init__(self, url: str, max_concurrency: int = 64, timeout_s: float = 600.0,
                 connect_timeout_s: float = 5.0, retries: int = 3, backoff_s: float = 0.5,
                 api_key: Optional[str] = None):
        self.url = url.rstrip("/")
        if not self.url.startswith("http"):
            self.url = "http://" + self.url
        # SGLang's --api-key (and the embedded server's MEGARL_API_KEY): sent on every request
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_concurrency = max_concurrency
        self._sem: Optional[asyncio.Semaphore] = None
        self._session: Optional[aiohttp.ClientSession] = None
        self._loop = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self):
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    def _sess(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # the semaphore bounds generations; the connection pool leaves room for control calls
            # (pause, continue, abort, weight updates), which must never queue behind generations:
            # a pause waiting for a slot held by a running request would wait for it to finish
            self._session = aiohttp.ClientSession(timeout=self.timeout, headers=self.headers,
                                                  connector=aiohttp.TCPConnector(
                                                      limit=self.max_concurrency + CONTROL_CONNECTIONS))
            self._sem = asyncio.Semaphore(self.max_concurrency)
            self._loop = loop
        return self._session

    async def _call(self, endpoint: str, payload: Optional[dict] = None, retry: bool = True,
                    expect_json: bool = True) -> Any:
        method, path = ENDPOINTS[endpoint]
        sess = self._sess()
        attempts = (self.retries + 1) if retry else 1
        last: Optional[BaseException] = None
        for a in range(attempts):
            try:
                async with (self._sem if endpoint == "generate" else contextlib.nullcontext()):
                    async with sess.request(method, self.url + path, json=payload) as r:
                        raw = await r.read()
                        if r.status >= 500 and retry and a + 1 < attempts:
                            last = RequestFailed(self.url, r.status, raw[:500].decode(errors="replace"))
                        elif r.status >= 400:
                            try:
                                body = await r.json(content_type=None)
                            except Exception:
                                body = raw[:2000].decode(errors="replace")
                            if r.status in (401, 403):
                                raise Unauthorized(self.url + path, r.status, body, bool(self.headers))
                            raise RequestFailed(self.url + path, r.status, body)
                        else:
                            if not expect_json:
                                return raw.decode(errors="replace")
                            if not raw:
                                return None
                            try:
                                return await r.json(content_type=None)
                            except Exception:
                                return raw.decode(errors="replace")
            except RequestFailed:
                raise
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError, aiohttp.ClientPayloadError) as e:
                last = e
            if a + 1 < attempts:
                await asyncio.sleep(self.backoff_s * (2 ** a) * (0.5 + random.random()))
        if isinstance(last, RequestFailed):
            raise last
        raise ServerDown(self.url, f"{path} unreachable after {attempts} attempt(s): {type(last).__name__}: {last}")

    # ------------------------------------------------------------------ generation
    async def generate(self, input_ids: Union[List[int], List[List[int]]],
                       sampling: Optional[Union[Dict[str, Any], List[Dict[str, Any]]]] = None,
                       return_logprob: bool = True, rid: Optional[Union[str, List[str]]] = None,
                       return_routed_experts: bool = False, routed_experts_start_len: int = 0,
                       lora_path: Optional[str] = None) -> List[GenerateOutput]:
        """Token ids in -> outputs (always a list: prompt-major, n per prompt). A batch is a list
        of prompts with one sampling dict for all or a list of one per prompt (SGLang's batch
        form: every item must have the same ``n``). With ``return_routed_experts`` (MoE, server
        started with --enable-return-routed-experts) each output carries the experts of every
        prompt and output position from ``routed_experts_start_len`` on (``routed_experts``)."""
        payload: Dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling or sampling_params(),
                                   "return_logprob": return_logprob, "stream": False}
        if return_routed_experts:
            payload["return_routed_experts"] = True
            if routed_experts_start_len:
                payload["routed_experts_start_len"] = int(routed_experts_start_len)
        return await self._generate(payload, rid, lora_path)

    async def _generate(self, payload: Dict[str, Any], rid: Optional[str], lora_path: Optional[str]
                        ) -> List[GenerateOutput]:
        """POST /generate with the request id and served adapter added when given; the outputs."""
        if rid is not None:
            payload["rid"] = rid
        if lora_path is not None:   # the served LoRA adapter (adapter-only pushes)
            payload["lora_path"] = lora_path
        out = await self._call("generate", payload)
        items = out if isinstance(out, list) else [out]
        return [GenerateOutput.from_json(d) for d in items]

    async def generate_with_images(self, input_ids: List[int], images: Sequence[Any], *, image_token_id: int,
                                   sampling: Optional[Dict[str, Any]] = None, return_logprob: bool = True,
                                   rid: Optional[str] = None, lora_path: Optional[str] = None) -> List[GenerateOutput]:
        """One prompt with images, token ids in -> outputs (a list, n per prompt), as `generate`.

        ``input_ids`` as the trainer keeps them: image placeholders already expanded, one
        ``image_token_id`` per vision token (`megarl.data.images.encode_with_images`). They are
        sent with each run of placeholders collapsed to one (`collapse_image_runs`): SGLang's
        multimodal processor keeps such ids verbatim and expands each placeholder to its image's
        token count (``BaseMultimodalProcessor._expand_input_ids``), which gives back exactly
        these ids; ids sent expanded it decodes to text and tokenizes again instead, which
        changes any ids that are not the tokenizer's own encoding of their text.

        ``images``: in placeholder order, each an `ImageRef`, raw bytes or a
        ``data:image/...;base64,`` URL; each is decoded here first, so a bad one (or a count that
        does not match the placeholders) is a one-line `BadImage` naming the request, before
        anything is sent."""
        sampling = sampling or sampling_params()
        name = _request_name(rid)
        ids = collapse_image_runs(input_ids, image_token_id)
        runs = sum(1 for t in ids if t == image_token_id)
        if runs != len(images):
            raise BadImage(f"{name}: input_ids hold {runs} image placeholder run(s) (token {image_token_id}) "
                           f"but {len(images)} image(s) were given")
        payload: Dict[str, Any] = {"input_ids": ids, "sampling_params": sampling,
                                   "image_data": image_data_field(images, int(sampling.get("n", 1) or 1), rid),
                                   "return_logprob": return_logprob, "stream": False}
        return await self._generate(payload, rid, lora_path)

    async def generate_raw(self, payload: Dict[str, Any]) -> Any:
        return await self._call("generate", payload)

    # ------------------------------------------------------------------ weights
    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> Dict[str, Any]:
        return await self._call("init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}, retry=False)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> Dict[str, Any]:
        return await self._call("destroy_weights_update_group", {"group_name": group_name}, retry=False)

    async def update_weights_from_distributed(self, names: List[str], dtypes: List[str], shapes: List[List[int]],
                                              group_name: str = "weight_update_group",
                                              load_format: Optional[str] = None, flush_cache: bool = True,
                                              weight_version: Optional[str] = None,
                                              checksums: Optional[List[str]] = None) -> Dict[str, Any]:
        p = _weights_payload({"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                              "flush_cache": flush_cache}, load_format, weight_version, checksums)
        return await self._call("update_weights_from_distributed", p, retry=False)

    async def update_weights_from_tensor(self, serialized_named_tensors: List[str], load_format: Optional[str] = None,
                                         flush_cache: bool = True, weight_version: Optional[str] = None,
                                         checksums: Optional[List[str]] = None) -> Dict[str, Any]:
        p = _weights_payload({"serialized_named_tensors": serialized_named_tensors, "flush_cache": flush_cache},
                             load_format, weight_version, checksums)
        return await self._call("update_weights_from_tensor", p, retry=False)

    async def update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None,
                                       weight_version: Optional[str] = None, flush_cache: bool = True) -> Dict[str, Any]:
        p: Dict[str, Any] = {"model_path": model_path, "flush_cache": flush_cache}
        if load_format is not None:
            p["load_format"] = load_format
        if weight_version is not None:
            p["weight_version"] = weight_version
        return await self._call("update_weights_from_disk", p, retry=False)

    async def load_lora_adapter_from_tensors(self, body: dict[str, Any]) -> Dict[str, Any]:
        """SGLang's ``/load_lora_adapter_from_tensors`` (body from ``megarl.sync.adapter``)."""
        return await self._call("load_lora_adapter_from_tensors", body, retry=False)

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> Dict[str, Any]:
        """SGLang's ``/load_lora_adapter``: a PEFT folder the server reads."""
        return await self._call("load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path}, retry=False)

    async def unload_lora_adapter(self, lora_name: str) -> Dict[str, Any]:
        return await self._call("unload_lora_adapter", {"lora_name": lora_name}, retry=False)

    async def update_weight_version(self, new_version: str) -> Any:
        """SGLang's ``/update_weight_version`` (requests in flight are kept: ``abort_all_requests`` false)."""
        return await self._call("update_weight_version", {"new_version": new_version, "abort_all_requests": False},
                                retry=False)

    async def begin_weight_update(self, selector: str = "all") -> Dict[str, Any]:
        """Open SGLang's weight-update session (0.5.23: updates outside one answer 400)."""
        return await self._call("begin_weight_update", {"selector": selector}, retry=False)

    async def end_weight_update(self) -> Dict[str, Any]:
        return await self._call("end_weight_update", {}, retry=False)

    async def pause_generation(self, mode: str = "abort") -> Any:
        """SGLang's /pause_generation: mode abort | retract | in_place."""
        return await self._call("pause_generation", {"mode": mode}, retry=False, expect_json=False)

    async def continue_generation(self) -> Any:
        return await self._call("continue_generation", {}, retry=False, expect_json=False)

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> Any:
        return await self._call("abort_request", {"rid": rid, "abort_all": abort_all}, retry=False,
                                expect_json=False)

    # ------------------------------------------------------------------ memory / cache / info
    async def flush_cache(self) -> str:
        return await self._call("flush_cache", None, expect_json=False)

    async def release_memory_occupation(self, tags: Optional[List[str]] = None):
        return await self._call("release_memory_occupation", {"tags": tags} if tags else {})

    async def resume_memory_occupation(self, tags: Optional[List[str]] = None):
        return await self._call("resume_memory_occupation", {"tags": tags} if tags else {})

    async def health(self) -> bool:
        """True iff the server answers /health with 200 (no retries; never raises)."""
        try:
            await self._call("health", None, retry=False, expect_json=False)
            return True
        except ServerError:
            return False

    async def wait_healthy(self, timeout_s: float = 120.0, poll_s: float = 0.2) -> None:
        loop = asyncio.get_running_loop()
        t_end = loop.time() + timeout_s
        while loop.time() < t_end:
            if await self.health():
                return
            await asyncio.sleep(poll_s)
        raise ServerDown(self.url, f"not healthy after {timeout_s:.0f}s")

    async def get_model_info(self) -> Dict[str, Any]:
        return await self._call("get_model_info", None)


class LoopThread:
    """An asyncio loop on a daemon thread, for synchronous callers (trainer ranks) that must issue
    HTTP calls *while* they run a blocking collective (broadcast) on their own thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._t = threading.Thread(target=self.loop.run_forever, name="megarl-http", daemon=True)
        self._t.start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout: Optional[float] = None):
        return self.submit(coro).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._t.join(timeout=5)
        if not self._t.is_alive():   # closed here, not by the garbage collector at interpreter exit
            self.loop.close()        # (which then prints "Exception ignored in BaseEventLoop.__del__")
