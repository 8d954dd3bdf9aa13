"""GPU only (run by ``benchmarks/run_gpu.sh gpu_tests``; CI's CPU suite is ``tests/``): weights and
KV cache released through CUDA VMM come back at the same addresses, so the engine's captured
decode graphs replay after a release/resume instead of being captured again, and give the tokens
of before. The reference for "released" is the driver's own free-memory count. (No unit control
with plain torch allocations: the driver may hand a freed range back at the same address, so
whether they move is chance; the loop measures it -- 2.8 captures a step without stable regions,
0.0 with them: benchmarks/RESULTS.md, GRPO loop on one GPU.)"""
from __future__ import annotations

import torch
from transformers import LlamaConfig

from megarl.engine.model import DecoderModel
from megarl.engine.stable_memory import StableRegion, stable_memory_available

DEV = torch.device("cuda")
PROMPTS = [[5, 17, 42, 99, 3], [7, 7, 250, 1], [300, 2, 9, 11, 13, 15], [4]]


def _config() -> LlamaConfig:
    return LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       tie_word_embeddings=False)


def _model() -> DecoderModel:
    m = DecoderModel(_config(), device="cuda", dtype=torch.bfloat16)
    m.init_dummy(seed=3)
    m.alloc_cache(8, 128)
    return m


def _greedy(m: DecoderModel, steps: int = 6) -> list[list[int]]:
    """Greedy continuations of PROMPTS (rows 0..3) through the model's decode graphs."""
    logits = m.prefill(PROMPTS, 0)
    out = [[int(t)] for t in logits.argmax(-1).tolist()]
    pos = [len(p) for p in PROMPTS]
    for _ in range(steps):
        logits = m.decode([o[-1] for o in out], pos)
        for o, t in zip(out, logits.argmax(-1).tolist()):
            o.append(int(t))
        pos = [p + 1 for p in pos]
    return out


def _release_and_resume(m: DecoderModel, keep: bool) -> int:
    """What a colocated step does to the engine: release weights and cache, let another user (the
    trainer) allocate that much meanwhile, resume. Returns the device bytes the release freed."""
    free = _free()
    m.offload_weights(keep=keep)
    m.free_cache()
    released = _free() - free
    trainer = torch.empty(released, dtype=torch.uint8, device=DEV)   # the freed memory, taken
    m.reload_weights()
    m.alloc_cache(8, 128)
    del trainer
    return released


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_a_released_region_frees_its_memory_and_comes_back_at_its_address():
    assert stable_memory_available(DEV)
    n = 512 << 20
    r = StableRegion(n, DEV)
    r.tensor.fill_(7)
    ptr = r.tensor.data_ptr()
    mapped = _free()
    r.release()
    released = _free()
    assert released - mapped >= n                     # the driver has the pages back
    r.restore()
    assert r.tensor.data_ptr() == ptr and released - _free() >= n
    r.tensor.fill_(3)
    assert int(r.tensor[::4096].to(torch.int64).sum()) == 3 * len(r.tensor[::4096])
    r.close()


def test_kept_weights_and_cache_resume_at_their_addresses_and_the_graphs_replay():
    m = _model()
    before = _greedy(m)
    captures, sig = m.graphs.captures, m.tensor_addresses()
    prefill_captures = m.prefill_graphs.captures
    assert prefill_captures == 1                      # the prompts' prefill is a graph too (the default)
    released = _release_and_resume(m, keep=True)
    assert released >= m._flat.numel() + 2 * 8 * 128 * 2 * 64 * 4 * 2     # weights + K/V bytes
    assert m.tensor_addresses() == sig
    assert _greedy(m) == before
    assert m.graphs.captures == captures              # replayed, not captured again
    assert m.prefill_graphs.captures == prefill_captures


def test_dropped_weights_pushed_again_serve_the_same_tokens_without_a_recapture():
    m = _model()
    saved = [(n, m.target(n).clone()) for n in m.hf_names() if not m.is_ignored(n)]
    before = _greedy(m)
    captures = m.graphs.captures
    _release_and_resume(m, keep=False)
    assert m.weights_stale()
    m.load_state(saved)
    assert not m.weights_stale()
    assert _greedy(m) == before and m.graphs.captures == captures
