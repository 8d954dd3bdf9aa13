#!/usr/bin/env bash
# SGLang 0.5.23's own server code on CPU, for the conformance tests (tests/test_sglang_conformance.py)
# and for trying megarl against real SGLang without a GPU (tests/sglang_cpu/launch_server.py).
#
# A separate virtual environment that sees the packages of the Python it is built from ($PYTHON or
# python3; a venv's own packages when that is a venv: torch 2.13 CPU, megarl, ...) and adds what
# SGLang's HTTP/tokenizer/scheduler code imports. It stays apart from megarl's own
# environment because triton (imported at module level by SGLang) must not change what torch and
# megatron-core do in the trainer. Nothing here pulls a CUDA torch: torch is already satisfied,
# and the packages that would ask for another torch are installed --no-deps.
# Usage: bash launch/install_sglang_cpu.sh [VENV_DIR]   (default: .venv-sglang-cpu in the repo)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${1:-${MEGARL_SGLANG_CPU_VENV:-$PWD/.venv-sglang-cpu}}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# Make the new venv see the packages of the environment it is built from. Not --system-site-packages:
# made from a venv's interpreter, that exposes the *base* interpreter's site-packages, not the venv
# that holds torch and megarl. A .pth line `import site; site.addsitedir(DIR)` appends each of $PY's
# own site dirs after the new venv's own (so its packages win) and runs their .pth files (editable
# installs, such as megarl's, are .pth files).
"$PY" - "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" <<'PY'
import sys
dirs = [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))]
lines = [f"import site; site.addsitedir({d!r})" for d in dirs]
with open(f"{sys.argv[1]}/_megarl_parent_env.pth", "w") as f:
    f.write("\n".join(lines) + "\n")
PY
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check --no-input -q "$@"; }
pip_install --no-deps sglang==0.5.23 compressed-tensors==0.18.0 xgrammar==0.2.7
# SGLang's pure-Python request/HTTP stack and the compiled helpers it imports at module level
# (openai and openai-harmony at SGLang's own pins: the parent env's are newer, for the verifiers hub)
pip_install triton==3.5.0 msgspec==0.23.0 fastapi==0.165.0 uvicorn==0.55.0 uvloop==0.23.0 pyzmq==27.3.0 \
    pybase64==1.5.1 python-multipart==0.0.34 setproctitle==1.3.8 partial-json-parser==0.2.1.1.post7 \
    einops==0.8.2 xxhash==4.1.0 orjson openai==2.8.0 openai-harmony==0.0.4 dill soundfile sentencepiece==0.2.1 loguru \
    apache-tvm-ffi==0.1.11
# sglang/utils.py imports IPython.display at module level; a fresh venv has no IPython of its own
pip_install ipython==9.18.1
"$VENV/bin/python" - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), f"SGLang CPU venv picked up torch {torch.__version__}"
import tests.sglang_cpu  # noqa: F401  (installs the off-path stand-ins)
import sglang.srt.entrypoints.http_server  # noqa: F401
print("SGLang CPU environment ready:", __import__("sys").prefix)
PY
