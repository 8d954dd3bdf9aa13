"""Embedded engine decode tokens/s vs HF `generate` on the same model and batch (one JSON line).

    python benchmarks/bench_rollout.py [--batch 8] [--new 64] [--model DIR | --smollm2]
Default model: a random llama (hidden 256, 4 layers, vocab 4096), fp32 on CPU.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--model", default=None)
    ap.add_argument("--smollm2", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.rollout.server.engine import Engine, Request, Sampling
    from megarl.rollout.server.model import DecoderModel
    from megarl.rollout.testing import make_tiny_hf_model
    d = a.model
    if a.smollm2:
        from megarl.models import smollm2_hf_dir
        d = str(smollm2_hf_dir())
    if d is None:
        d = tempfile.mkdtemp()
        make_tiny_hf_model(d, "llama", vocab_size=4096, hidden_size=256, intermediate_size=768,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, std=0.05)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, hf.config.vocab_size, (a.batch, a.prompt), generator=g)

    def run_hf():
        t = time.perf_counter()
        out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=a.new,
                          min_new_tokens=a.new, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t, out.shape[1] - a.prompt

    model = DecoderModel(AutoConfig.from_pretrained(d))
    model.load_hf_dir(d)
    eng = Engine(model, max_running=a.batch, max_len=a.prompt + a.new + 1)
    eng.start()

    def run_engine():
        t = time.perf_counter()
        futs = [eng.submit(Request(p.tolist(), Sampling(max_new_tokens=a.new, temperature=0.0, ignore_eos=True)))
                for p in prompts]
        outs = [f.result() for f in futs]
        return time.perf_counter() - t, len(outs[0]["output_ids"])

    run_hf(), run_engine()  # warm-up
    th, nh = min(run_hf() for _ in range(2))
    te, ne = min(run_engine() for _ in range(2))
    eng.stop()
    res = {"bench": "rollout_decode", "model": os.path.basename(d.rstrip("/")) if a.model or a.smollm2 else "llama-h256-l4-v4096",
           "batch": a.batch, "prompt_len": a.prompt, "new_tokens": a.new, "threads": a.threads, "device": "cpu",
           "embedded_tokens_per_s": a.batch * ne / te, "hf_generate_tokens_per_s": a.batch * nh / th,
           "ratio_embedded_over_hf": (a.batch * ne / te) / (a.batch * nh / th)}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
