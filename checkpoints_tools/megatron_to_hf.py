"""Thin wrapper: python checkpoints_tools/megatron_to_hf.py --ckpt DIR --out DIR [--tp 1 ...]"""
import sys

from megarl.checkpoint.cli import convert_main

if __name__ == "__main__":
    raise SystemExit(convert_main(["megatron-to-hf", *sys.argv[1:]]))
