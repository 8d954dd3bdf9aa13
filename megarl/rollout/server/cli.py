"""`megarl serve MODEL --port P` / `python -m megarl.rollout.server MODEL --port P`.

MODEL is an HF-layout folder (config.json + *.safetensors [+ tokenizer files]).  The HTTP socket
opens first (`/health` answers 503 while loading, 200 once the weights are in), then the model
loads.  Binds 127.0.0.1 unless --host says otherwise.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import threading
from typing import List, Optional

log = logging.getLogger("megarl.rollout.server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megarl serve", description="megarl embedded rollout server (SGLang native API subset)")
    p.add_argument("model", help="HF-layout model folder (config.json + *.safetensors)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto")
    p.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto (fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--max-running-requests", type=int, default=32, help="KV-cache slots = max concurrent sequences")
    p.add_argument("--context-length", type=int, default=2048, help="max prompt + output tokens per sequence")
    p.add_argument("--max-prefill-tokens", type=int, default=8192, help="prompt tokens admitted per step")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--skip-tokenizer-init", action="store_true", help="token ids only (no text in/out)")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=0, help="torch intra-op threads on CPU (0 = torch default)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--weights-dir", default=None,
                   help="/update_weights_from_disk loads only from this folder or below (unset: disk updates refused)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: no weight files needed (config.json only), random weights (as sglang's)")
    return p


def _load(state, args):
    import torch
    from transformers import AutoConfig

    from .engine import Engine
    from .model import DecoderModel
    from .weights import WeightReceiver
    try:
        dev = args.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        dt = args.dtype
        if dt == "auto":
            dt = "bfloat16" if dev.startswith("cuda") else "float32"
        cfg = AutoConfig.from_pretrained(args.model)
        model = DecoderModel(cfg, device=dev, dtype=getattr(torch, dt))
        if args.load_format == "dummy":
            g = torch.Generator(device=model.device).manual_seed(args.random_seed)
            for t in model.params.values():
                t.normal_(0.0, 0.02, generator=g) if t.dim() > 1 else t.fill_(1.0)
        else:
            model.load_hf_dir(args.model)
        if not args.skip_tokenizer_init:
            try:
                from transformers import AutoTokenizer
                state.tokenizer = AutoTokenizer.from_pretrained(args.model)
            except Exception as e:  # a weights-only folder: token ids only
                log.info("no tokenizer (%s); serving token ids only", type(e).__name__)
        eng = Engine(model, max_running=args.max_running_requests, max_len=args.context_length,
                     max_prefill_tokens=args.max_prefill_tokens, seed=args.random_seed)
        state.receiver = WeightReceiver(model, weights_dir=args.weights_dir)
        eng.start()
        state.engine = eng
        state.ready = True
        log.info("model %s loaded (%s, %s)", args.model, dev, dt)
    except Exception as e:
        log.exception("model load failed")
        state.load_error = f"model load failed: {type(e).__name__}: {e}"


async def _amain(args) -> int:
    from aiohttp import web

    from .app import ServerState, build_app
    state = ServerState(args.model, args.served_model_name)
    app = build_app(state)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    print(f"megarl serve: listening on http://{args.host}:{args.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except NotImplementedError:
            pass
    t = threading.Thread(target=_load, args=(state, args), daemon=True)
    t.start()
    while t.is_alive():
        await asyncio.sleep(0.05)
    if state.ready:
        print(f"megarl serve: ready ({args.model})", flush=True)
    await stop.wait()
    if state.engine:
        state.engine.stop()
    await runner.cleanup()
    return 0 if state.ready else 1


def serve_main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.num_threads:
        import torch
        torch.set_num_threads(args.num_threads)
    return asyncio.run(_amain(args))


if __name__ == "__main__":
    sys.exit(serve_main())
