"""Block FP8 quantization against SGLang 0.5.23's own code, run in the SGLang CPU environment.

Reference: `sglang.srt.layers.quantization.fp8_utils.per_block_cast_to_fp8` (ue8m0 scales, bytes
compared) and `block_quant_dequant` (SGLang's dequantizer, applied to megarl's fp32-scale output).
"""

import subprocess
from pathlib import Path

import torch
from safetensors.torch import load_file

from megarl.quant import fp8_block
from megarl.quant.fp8_block import dequantize_block_fp8, quantize_block_fp8
from tests.helpers.runs import tiny_model
from tests.sglang_cpu.server import ROOT, harness_env, sglang_cpu_python

_REF = r"""
import sys, torch
import tests.sglang_cpu  # noqa: F401
from sglang.srt.layers.quantization.fp8_utils import per_block_cast_to_fp8, block_quant_dequant
inp = torch.load(sys.argv[1])
out = {}
for k, w in inp["weights"].items():
    q, s = per_block_cast_to_fp8(w)
    out[k] = (q.view(torch.uint8), s)
for k, (q, s) in inp["fp32"].items():
    out["deq/" + k] = block_quant_dequant(q.view(torch.float8_e4m3fn), s, [128, 128], torch.float32)
torch.save(out, sys.argv[2])
"""


def _weights(tmp_path: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ws = {"rand_bf16_300x200": (torch.randn(300, 200, generator=g) * 0.02).bfloat16(),
          "rand_f32_256x384": torch.randn(256, 384, generator=g) * 3.0,
          "rand_tiny_128x128": torch.randn(128, 128, generator=g) * 1e-7,
          "zeros_130x129": torch.zeros(130, 129, dtype=torch.bfloat16),
          "rand_bf16_640x512": (torch.randn(640, 512, generator=g) * 0.05).bfloat16()}
    real = load_file(str(next(tiny_model(tmp_path).glob("*.safetensors"))))
    ws.update({f"real/{k}": v for k, v in real.items() if v.dim() == 2})
    return ws


def test_block_fp8_bytes_match_sglang_and_dequantize_with_sglang(tmp_path, monkeypatch):
    # one block row per scaled chunk: the banded multiply is held to SGLang's bytes too (a real
    # projection takes several bands; these test weights would otherwise fit in one)
    monkeypatch.setattr(fp8_block, "_SCALE_CHUNK_ELEMENTS", 128 * 128)
    ws = _weights(tmp_path)
    fp32 = {k: quantize_block_fp8(w, scale_format="fp32") for k, w in ws.items()}
    inp, out = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save({"weights": ws, "fp32": {k: (q.view(torch.uint8), s) for k, (q, s) in fp32.items()}}, inp)
    done = subprocess.run([sglang_cpu_python(), "-c", _REF, str(inp), str(out)], capture_output=True, text=True,
                          env=harness_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ref = torch.load(out)
    for k, w in ws.items():
        q, s = quantize_block_fp8(w)
        assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape, k
        assert torch.equal(q.view(torch.uint8), ref[k][0]), k
        assert torch.equal(s, ref[k][1]), k
        fq, fs = fp32[k]
        assert torch.equal(dequantize_block_fp8(fq, fs, dtype=torch.float32), ref["deq/" + k]), k
        # e4m3 has 3 mantissa bits: each element is within half an ulp (2^-4 relative) of its block max
        err = (ref["deq/" + k] - w.float()).abs()
        bound = fs.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]] * 448 / 16
        assert bool((err <= bound + 1e-30).all()), k
