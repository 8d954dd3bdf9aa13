"""``megarl convert`` command: ``convert_main(argv) -> int``.

    megarl convert hf-to-megatron --hf DIR --out DIR [--tp 2 --pp 1 --ep 1 --etp 1 --vpp N --dtype bf16]
    megarl convert megatron-to-hf --ckpt DIR --out DIR [--hf-config DIR --tp 1 --pp 1 --ep 1]
    megarl convert lora-to-peft --ckpt RUN/checkpoints/step_N --out DIR [--merged DIR] [--run-config FILE]
    megarl convert hf-to-fp8 --hf DIR --out DIR [--scale-fmt fp32|ue8m0] [--readable-by sglang,transformers]
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megarl convert", description="HF <-> megatron checkpoints, LoRA -> PEFT, HF -> block FP8")
    sub = p.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-megatron", help="HF safetensors folder -> megatron torch_dist")
    a.add_argument("--hf", required=True, help="HF folder (config.json + *.safetensors)")
    a.add_argument("--out", required=True, help="output checkpoint directory")
    b = sub.add_parser("megatron-to-hf", help="megatron torch_dist -> HF safetensors folder")
    b.add_argument("--ckpt", required=True, help="megarl megatron checkpoint directory")
    b.add_argument("--out", required=True, help="output HF folder")
    b.add_argument("--hf-config", default=None,
                   help="folder with config.json/tokenizer files (default: the checkpoint's hf/)")
    b.add_argument("--max-shard-gb", type=float, default=4.0)
    c = sub.add_parser("lora-to-peft", help="LoRA training checkpoint -> PEFT adapter (+ merged HF model)")
    c.add_argument("--ckpt", required=True, help="a LoRA run's checkpoint folder (RUN/checkpoints/step_N)")
    c.add_argument("--out", required=True, help="output PEFT adapter folder")
    c.add_argument("--merged", default=None, help="also write the merged HF model here")
    c.add_argument("--run-config", default=None, help="the run's config.json (default: RUN/config.json)")
    d = sub.add_parser("hf-to-fp8", help="HF folder -> block-FP8 HF folder (DeepSeek-V3 format) for FP8 rollout")
    d.add_argument("--hf", required=True, help="HF folder (config.json + *.safetensors), bf16/fp32")
    d.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    d.add_argument("--scale-fmt", default="fp32", choices=["fp32", "ue8m0"],
                   help="fp32: amax/448 per block (DeepSeek-V3); ue8m0: rounded up to a power of two (DeepGEMM)")
    d.add_argument("--readable-by", default="", type=lambda v: [x for x in v.split(",") if x],
                   help="comma-separated loaders (sglang, transformers) that must read the result right: refuse, "
                        "writing nothing, when a padded 128-block would make one refuse or misread it (without "
                        "it, a one-line warning names them; megarl serve reads every dim)")
    d.add_argument("--quiet", action="store_true")
    for s in (a, b):
        s.add_argument("--tp", type=int, default=1, help="tensor parallel ranks used to convert")
        s.add_argument("--pp", type=int, default=1, help="pipeline stages used to convert")
        s.add_argument("--ep", type=int, default=1, help="expert parallel ranks used to convert")
        s.add_argument("--etp", type=int, default=1, help="expert tensor parallel size")
        s.add_argument("--quiet", action="store_true")
    a.add_argument("--vpp", type=int, default=None, help="virtual pipeline chunks")
    a.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16", "float32",
                                                     "bfloat16", "float16"],
                   help="params dtype (default: dtype of the HF tensors)")
    return p


def convert_main(argv: Optional[List[str]] = None) -> int:
    import os
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    from .convert import convert_hf_to_megatron, convert_megatron_to_hf
    from .manifest import CheckpointVerificationError
    try:
        if args.direction == "hf-to-fp8":
            from .fp8_convert import convert_hf_to_fp8

            convert_hf_to_fp8(args.hf, args.out, args.scale_fmt, verbose=not args.quiet,
                              readable_by=args.readable_by)
        elif args.direction == "lora-to-peft":
            from .lora_export import convert_lora_to_peft

            n = convert_lora_to_peft(args.ckpt, args.out, args.merged, args.run_config)
            print(f"[megarl.convert] wrote {n} adapter tensors to {args.out}" +
                  (f" and the merged model to {args.merged}" if args.merged else ""))
        elif args.direction == "hf-to-megatron":
            convert_hf_to_megatron(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep,
                                   etp=args.etp, vpp=args.vpp, dtype=args.dtype, verbose=not args.quiet)
        else:
            convert_megatron_to_hf(args.ckpt, args.out, args.hf_config, tp=args.tp, pp=args.pp,
                                   ep=args.ep, etp=args.etp, max_shard_gb=args.max_shard_gb,
                                   verbose=not args.quiet)
    except (CheckpointVerificationError, KeyError, FileNotFoundError, ValueError) as e:
        print(f"megarl convert: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # SpawnError carries the failing rank's traceback
        print(f"megarl convert: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(convert_main())
