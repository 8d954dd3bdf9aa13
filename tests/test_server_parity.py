"""Embedded rollout server vs HF transformers: greedy tokens, logprobs, batching (real processes)."""
import asyncio
import time

import pytest
import torch

from megarl.rollout.client import SGLangClient, sampling_params
from tests.helpers.servers import ServerProcess, make_tiny_hf_model

torch.set_num_threads(1)
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12], [200, 100, 50, 25, 12, 6, 3, 1, 0, 9, 8]]


def hf_logprobs(model, prompt, out_ids, temperature=1.0):
    ids = torch.tensor([prompt + out_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    if temperature > 0:
        logits = logits / temperature
    lp = torch.log_softmax(logits, -1)
    return torch.stack([lp[len(prompt) - 1 + i, t] for i, t in enumerate(out_ids)])


async def _gen_all(url, prompts, sp):
    async with SGLangClient(url) as c:
        return await asyncio.gather(*[c.generate(p, sp) for p in prompts])


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_tiny_greedy_and_logprobs_match_hf(tmp_path, family):
    d = str(tmp_path / family)
    hf = make_tiny_hf_model(d, family, std=0.3)
    with ServerProcess(d) as s:
        outs = asyncio.run(_gen_all(s.url, PROMPTS, sampling_params(max_new_tokens=12, temperature=0)))
        sampled = asyncio.run(_gen_all(s.url, PROMPTS[:2], sampling_params(
            max_new_tokens=10, temperature=0.7, top_p=0.9, top_k=50, sampling_seed=3)))
    for p, o in zip(PROMPTS, outs):
        o = o[0]
        ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert o.output_ids == ref, (family, p)
        assert o.finish_reason == "length" and len(o.logprobs) == 12
        diff = (hf_logprobs(hf, p, o.output_ids) - torch.tensor(o.logprobs)).abs().max().item()
        assert diff < 1e-4, diff
    # sampled tokens: logprob = log_softmax(logits / T) of the same fp32 logits (pre top-p/top-k)
    for p, o in zip(PROMPTS, sampled):
        o = o[0]
        diff = (hf_logprobs(hf, p, o.output_ids, 0.7) - torch.tensor(o.logprobs)).abs().max().item()
        assert diff < 1e-4, diff


def test_smollm2_greedy_and_logprobs_match_hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from megarl.checkpoint.smollm2 import smollm2_hf_dir
    d = str(smollm2_hf_dir())
    tok = AutoTokenizer.from_pretrained(d)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    msgs = [[{"role": "user", "content": "What is 2+2?"}], [{"role": "user", "content": "Name a color."}]]
    prompts = [list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)) for m in msgs]
    prompts = [p["input_ids"] if isinstance(p, dict) else p for p in prompts]
    N = 16
    with ServerProcess(d, threads=2) as s:
        outs = asyncio.run(_gen_all(s.url, prompts, sampling_params(max_new_tokens=N, temperature=0)))
        info = asyncio.run(_info(s.url))
    assert info["model_type"] == "llama"
    for p, o in zip(prompts, outs):
        o = o[0]
        ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=N, do_sample=False)[0, len(p):].tolist()
        assert o.output_ids == ref[: len(o.output_ids)]
        if o.finish_reason == "stop":  # stopped at eos exactly where HF did
            assert len(ref) == len(o.output_ids) and o.matched == ref[-1]
        else:
            assert len(o.output_ids) == N
        diff = (hf_logprobs(hf, p, o.output_ids) - torch.tensor(o.logprobs)).abs().max().item()
        assert diff < 1e-4, diff
        assert o.text is not None


async def _info(url):
    async with SGLangClient(url) as c:
        return await c.get_model_info()


def test_concurrent_requests_are_batched(tmp_path, capsys):
    d = str(tmp_path / "m")
    make_tiny_hf_model(d, "llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4)
    sp = sampling_params(max_new_tokens=96, temperature=0, ignore_eos=True)

    async def run(url):
        async with SGLangClient(url) as c:
            t0 = time.perf_counter()
            await c.generate([1, 2, 3], sampling_params(max_new_tokens=4))  # warm up
            t = time.perf_counter()
            await c.generate([1, 2, 3], sp)
            await c.generate([4, 5, 6], sp)
            seq = time.perf_counter() - t
            t = time.perf_counter()
            a, b = await asyncio.gather(c.generate([1, 2, 3], sp), c.generate([4, 5, 6], sp))
            conc = time.perf_counter() - t
            return seq, conc, await c.get_model_info(), time.perf_counter() - t0

    with ServerProcess(d) as s:
        seq, conc, info, wall = asyncio.run(run(s.url))
    with capsys.disabled():
        print(f"\n[batching] two requests in a row: {seq:.3f}s, at once: {conc:.3f}s "
              f"(x{seq / conc:.2f}), max decode batch {info['megarl_stats']['max_batch']}")
    assert info["megarl_stats"]["max_batch"] >= 2  # both were in one decode batch
    # the engine thread's own seconds: some admitting and decoding, within the time the client
    # waited for its requests (the slack: the idle loop's empty admissions before the first one)
    stats = info["megarl_stats"]
    assert stats["admit_s"] > 0 and stats["decode_s"] > 0
    assert stats["admit_s"] + stats["decode_s"] < wall + 1.0


def test_batch_form_with_n_and_per_item_params(tmp_path):
    """SGLang's batch form: a list of input_ids with one sampling_params per item and n per item;
    the answer is prompt-major (n per item). Seeded samples of one item differ (seeds derived per
    sample), sample 0 is the item's seed itself, greedy items are HF's."""
    d = str(tmp_path / "m")
    hf = make_tiny_hf_model(d, "llama", std=0.3)

    async def run(url):
        async with SGLangClient(url) as c:
            batch = await c.generate(PROMPTS[:2], [sampling_params(max_new_tokens=5, temperature=1.0, n=3, sampling_seed=9),
                                                   sampling_params(max_new_tokens=7, temperature=0.0, n=3)])
            single = await c.generate(PROMPTS[0], sampling_params(max_new_tokens=5, temperature=1.0, sampling_seed=9))
            again = await c.generate(PROMPTS[:1], [sampling_params(max_new_tokens=5, temperature=1.0, n=3,
                                                                   sampling_seed=9)])
            return batch, single, again
    with ServerProcess(d) as s:
        batch, single, again = asyncio.run(run(s.url))
    assert len(batch) == 6 and [len(o.output_ids) for o in batch] == [5, 5, 5, 7, 7, 7]
    assert batch[0].output_ids == single[0].output_ids
    assert len({tuple(o.output_ids) for o in batch[:3]}) == 3
    assert [o.output_ids for o in again] == [o.output_ids for o in batch[:3]]
    ref = hf.generate(torch.tensor([PROMPTS[1]]), attention_mask=torch.ones(1, len(PROMPTS[1]), dtype=torch.long),
                      max_new_tokens=7, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(PROMPTS[1]):].tolist()
    assert all(o.output_ids == ref for o in batch[3:])
    for o in batch[:3]:
        diff = (hf_logprobs(hf, PROMPTS[0], o.output_ids) - torch.tensor(o.logprobs)).abs().max().item()
        assert diff < 1e-4, diff
