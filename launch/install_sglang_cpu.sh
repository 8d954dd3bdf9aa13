#!/usr/bin/env bash
# SGLang 0.5.23's own server code on CPU, for the conformance tests (tests/test_sglang_conformance.py)
# and for trying megarl against real SGLang without a GPU (tests/sglang_cpu/launch_server.py).
#
# A separate virtual environment that sees this Python's packages (torch 2.13 CPU, megarl, ...)
# and adds what SGLang's HTTP/tokenizer/scheduler code imports. It stays apart from megarl's own
# environment because triton (imported at module level by SGLang) must not change what torch and
# megatron-core do in the trainer. Nothing here pulls a CUDA torch: torch is already satisfied,
# and the packages that would ask for another torch are installed --no-deps.
# Usage: bash launch/install_sglang_cpu.sh [VENV_DIR]   (default: .venv-sglang-cpu in the repo)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${1:-${MEGARL_SGLANG_CPU_VENV:-$PWD/.venv-sglang-cpu}}
[ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check --no-input -q "$@"; }
pip_install --no-deps sglang==0.5.23 compressed-tensors==0.18.0 xgrammar==0.2.7
# SGLang's pure-Python request/HTTP stack and the compiled helpers it imports at module level
pip_install triton==3.5.0 msgspec==0.23.0 fastapi==0.165.0 uvicorn==0.55.0 uvloop==0.23.0 pyzmq==27.3.0 \
    pybase64==1.5.1 python-multipart==0.0.34 setproctitle==1.3.8 partial-json-parser==0.2.1.1.post7 \
    einops==0.8.2 xxhash==4.1.0 orjson openai==2.8.0 dill soundfile sentencepiece==0.2.1 loguru \
    apache-tvm-ffi==0.1.11
"$VENV/bin/python" - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), f"SGLang CPU venv picked up torch {torch.__version__}"
import tests.sglang_cpu  # noqa: F401  (installs the off-path stand-ins)
import sglang.srt.entrypoints.http_server  # noqa: F401
print("SGLang CPU environment ready:", __import__("sys").prefix)
PY
