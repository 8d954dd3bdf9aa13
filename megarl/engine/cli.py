"""`megarl serve MODEL --port P` / `python -m megarl.engine MODEL --port P`.

MODEL is an HF-layout folder (config.json + *.safetensors [+ tokenizer files]). Start-up:
  1. checks that need no weights, each a one-line error and exit code 2: the config loads, the
     TP size divides heads / kv heads / intermediate sizes, the devices exist;
  2. `--tp-size N` > 1: ranks 1..N-1 start as child processes (`tp.py`, `follower.py`);
  3. the HTTP socket opens (`/health` answers 503 while loading, 200 once the weights are in),
     then every rank loads its shard.
Binds 127.0.0.1 unless --host says otherwise. The API key comes from the environment
(`MEGARL_API_KEY`, or the variable `--api-key-env` names), never from the command line; without
one the server runs open and says so. `/update_weights_from_disk` and `/load_lora_adapter` read
only under `--weights-dir` (refused when the option is not given); the LoRA endpoints need
`--enable-lora`.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
from typing import Any, List, Optional

from .auth import DEFAULT_API_KEY_ENV, read_api_key

log = logging.getLogger("megarl.engine")


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: "--api-key SECRET" must not be taken for "--api-key-env SECRET"
    p = argparse.ArgumentParser(prog="megarl serve", allow_abbrev=False,
                                description="megarl embedded rollout server (SGLang native API subset)")
    p.add_argument("model", help="HF-layout model folder (config.json + *.safetensors)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto")
    p.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto (fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--tp-size", type=int, default=1,
                   help="tensor-parallel ranks (processes; on CUDA one GPU each, cuda:0..N-1 of CUDA_VISIBLE_DEVICES)")
    p.add_argument("--max-running-requests", type=int, default=32, help="KV-cache slots = max concurrent sequences")
    p.add_argument("--context-length", type=int, default=2048, help="max prompt + output tokens per sequence")
    p.add_argument("--max-prefill-tokens", type=int, default=8192, help="prompt tokens admitted per step")
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="no prefix sharing: prefill every request on its own, even the samples of one prompt "
                        "(SGLang's flag of the same name; for benchmarks)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--skip-tokenizer-init", action="store_true", help="token ids only (no text in/out)")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=0, help="torch intra-op threads per rank on CPU (0 = torch default)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: no weight files needed (config.json only), random weights (as sglang's)")
    p.add_argument("--weights-dir", default=None,
                   help="/update_weights_from_disk loads only from this folder or below it (realpath); "
                        "without it disk updates are refused")
    p.add_argument("--enable-fp32-lm-head", action="store_true",
                   help="output projection in fp32 (logits never rounded to the model dtype), as SGLang's flag")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="MoE: record each token's routed experts; requests ask for them with "
                        "return_routed_experts (SGLang's flag and wire format)")
    p.add_argument("--enable-weights-cpu-backup", action="store_true",
                   help="keep the weights in host memory while released (/release_memory_occupation); without "
                        "it they are dropped, as SGLang drops them, and must be pushed again before generating")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (SGLang's flag): /load_lora_adapter_from_tensors, /load_lora_adapter "
                        "(PEFT folders under --weights-dir only), /unload_lora_adapter, /generate's lora_path")
    p.add_argument("--api-key-env", default=DEFAULT_API_KEY_ENV,
                   help=f"environment variable holding the API key (default {DEFAULT_API_KEY_ENV}); "
                        "the key itself is never a command-line argument")
    return p


def _fail(msg: str) -> int:
    print(f"megarl serve: error: {msg}", file=sys.stderr, flush=True)
    return 2


def _load(state, opts, hf_config, args, on_fatal) -> None:
    """Rank 0's loader thread: join the TP group, load, start the engine."""
    from .engine import Engine
    from .tp import Lockstep
    from .worker import ModelHandle, build_worker
    try:
        worker = build_worker(opts, 0, hf_config)
        handle = ModelHandle(Lockstep(worker, worker.comm, on_fatal))
        if not args.skip_tokenizer_init:
            try:
                from transformers import AutoTokenizer
                state.tokenizer = AutoTokenizer.from_pretrained(args.model)
            except Exception as e:  # a weights-only folder: token ids only
                log.info("no tokenizer (%s); serving token ids only", type(e).__name__)
        eng = Engine(handle, max_running=args.max_running_requests, max_len=args.context_length,
                     max_prefill_tokens=args.max_prefill_tokens, seed=args.random_seed,
                     prefix_sharing=not args.disable_radix_cache)
        state.worker, state.handle = worker, handle
        eng.start()
        state.engine = eng
        state.ready = True
        log.info("model %s loaded (%s, %s, tp %d)", args.model, opts.device, opts.dtype, opts.tp_size)
    except Exception as e:
        log.exception("model load failed")
        state.load_error = f"model load failed: {type(e).__name__}: {e}"


async def _amain(args, opts, hf_config, followers, api_key: Optional[str]) -> int:
    from aiohttp import web

    from .app import ServerState, build_app
    state = ServerState(args.model, args.served_model_name, tp_size=opts.tp_size, weights_dir=opts.weights_dir,
                        enable_lora=args.enable_lora, weights_cpu_backup=args.enable_weights_cpu_backup)
    app = build_app(state, api_key)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    print(f"megarl serve: listening on http://{args.host}:{args.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    fatal: List[str] = []

    def on_fatal(msg: str) -> None:
        """A TP rank died or the ranks fell out of step: serve nothing more, exit."""
        if not fatal:
            fatal.append(msg)
            log.error("shutting down: %s", msg)
            state.ready = False
            state.load_error = msg
            loop.call_soon_threadsafe(stop.set)
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except NotImplementedError:
            pass
    if followers is not None:
        followers.watch(on_fatal)
    t = threading.Thread(target=_load, args=(state, opts, hf_config, args, on_fatal), daemon=True)
    t.start()
    while t.is_alive() and not stop.is_set():
        await asyncio.sleep(0.05)
    if state.ready:
        print(f"megarl serve: ready ({args.model}, tp {opts.tp_size})", flush=True)
    await stop.wait()
    # answer what the server holds before the web runner waits for its handlers: requests waiting
    # out a pause (503) and those in the engine (aborted with their tokens)
    await state.generation.close()
    if state.engine:
        state.engine.stop()
    if state.handle is not None:
        state.handle.lockstep.stop()
    if followers is not None:
        followers.stop()
    await runner.cleanup()
    return 0 if state.ready and not fatal else 1


def serve_main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a == "--api-key" or a.startswith("--api-key=") for a in argv):
        return _fail(f"--api-key is not accepted (command lines are visible to every user): put the key in "
                     f"the environment variable {DEFAULT_API_KEY_ENV} (or the one --api-key-env names)")
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    api_key = read_api_key(args.api_key_env)
    os.environ.pop(args.api_key_env, None)        # not inherited by the TP ranks or anything else
    if api_key is None:
        log.warning("no API key (environment variable %s is unset): every endpoint is open to anyone who can "
                    "reach %s:%d", args.api_key_env, args.host, args.port)
    opts, hf_config, err = _plan(args)
    if err:
        return _fail(err)
    followers = None
    if opts.tp_size > 1:
        from .tp import Followers
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        followers = Followers.spawn(opts.tp_size, opts.to_dict(), env)   # from the main thread (PDEATHSIG)
    try:
        code = asyncio.run(_amain(args, opts, hf_config, followers, api_key))
    finally:
        if followers is not None:
            followers.stop(timeout_s=2.0)
    if code != 0 and followers is not None:
        # a rank died (or the ranks fell out of step): everything is stopped, but the process group
        # still names a dead peer, and tearing it down at interpreter exit can abort (SIGABRT, seen
        # once under a loaded CI box) -- the exit code must say what happened, so skip the teardown
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _plan(args) -> "tuple[Any, Any, Optional[str]]":
    """(RankOptions, HF config, None) or (None, None, one-line error): everything that can be
    refused before a process is spawned or a weight is read."""
    import torch

    from .tp import open_tp_store
    from .worker import RankOptions, check_tp
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    dev = args.device
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = args.dtype
    if dt == "auto":
        dt = "bfloat16" if dev.startswith("cuda") else "float32"
    if not isinstance(getattr(torch, dt, None), torch.dtype):
        return None, None, f"--dtype {args.dtype!r} is not a torch dtype"
    try:
        from transformers import AutoConfig
        hf_config = AutoConfig.from_pretrained(args.model)
    except Exception as e:  # noqa: BLE001 - one line for any unreadable config
        return None, None, f"cannot read the model config of {args.model}: {type(e).__name__}: {e}"
    try:
        err = check_tp(hf_config, args.tp_size, dev)
    except ValueError as e:           # unsupported model_type
        return None, None, str(e)
    if err:
        return None, None, err
    weights_dir = None
    if args.weights_dir:
        os.makedirs(args.weights_dir, mode=0o700, exist_ok=True)
        weights_dir = os.path.realpath(args.weights_dir)
    opts = RankOptions(model=args.model, device=dev, dtype=dt, load_format=args.load_format,
                       random_seed=args.random_seed, tp_size=args.tp_size,
                       tp_port=open_tp_store(args.tp_size) if args.tp_size > 1 else 0, weights_dir=weights_dir,
                       num_threads=args.num_threads, fp32_lm_head=args.enable_fp32_lm_head,
                       return_routed_experts=args.enable_return_routed_experts)
    return opts, hf_config, None


if __name__ == "__main__":
    sys.exit(serve_main())
