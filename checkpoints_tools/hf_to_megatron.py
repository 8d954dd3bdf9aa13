"""Thin wrapper: python checkpoints_tools/hf_to_megatron.py --hf DIR --out DIR [--tp 2 ...]"""
import sys

from megarl.checkpoint.cli import convert_main

if __name__ == "__main__":
    raise SystemExit(convert_main(["hf-to-megatron", *sys.argv[1:]]))
