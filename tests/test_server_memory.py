"""Colocated servers lending their weights' memory to the trainer (`/release_memory_occupation`).

SGLang's memory saver drops released weights unless the server runs with
``--enable-weights-cpu-backup``; the embedded engine now does the same (it used to copy them to a
fresh host buffer every step). These tests hold the engine to that contract -- dropped weights are
refused until pushed, kept weights come back unchanged -- and the launcher to asking for the host
copy exactly where released weights come back without a push."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from megarl.engine.engine import Engine, Request, Sampling
from megarl.engine.model import DecoderModel
from tests.helpers.servers import make_tiny_hf_model

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [5, 17, 42, 99, 3, 250, 7]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("release") / "m")
    make_tiny_hf_model(d, "llama", std=0.3)
    return d


def _model(d: str) -> DecoderModel:
    m = DecoderModel(AutoConfig.from_pretrained(d))
    m.load_hf_dir(d)
    return m


def _greedy(eng: Engine) -> list[int]:
    req = Request(list(PROMPT), Sampling(max_new_tokens=8, temperature=0.0))
    return eng.submit_many([req])[0].result(timeout=120)["output_ids"]


def test_dropped_weights_are_refused_until_pushed_then_serve_as_before(tiny):
    model = _model(tiny)
    eng = Engine(model, max_running=2, max_len=64)
    eng.start()
    try:
        before = _greedy(eng)
        model.offload_weights(keep=False)
        assert all(p.device.type == "meta" for p in model.params.values())   # nothing held anywhere
        model.reload_weights()
        assert model.weights_stale()
        with pytest.raises(RuntimeError, match="enable-weights-cpu-backup"):
            _greedy(eng)
        model.load_hf_dir(tiny)        # the push (any weight update clears the flag)
        assert not model.weights_stale()
        assert _greedy(eng) == before
    finally:
        eng.stop()


def test_updates_into_released_weights_are_refused_and_a_partial_push_does_not_serve(tiny):
    """SGLang's order is resume, then push: a push into released weights would land nowhere (dropped)
    and must not clear the guard; after a drop the model serves again only once every weight of it
    has been written, not after the first tensor."""
    model = _model(tiny)
    model.offload_weights(keep=False)
    with pytest.raises(RuntimeError, match="resume them before updating"):
        model.load_hf_dir(tiny)
    assert model.weights_stale()
    model.reload_weights()
    from safetensors.torch import load_file
    tensors = load_file(str(Path(tiny) / "model.safetensors"))
    first = sorted(tensors)[0]
    model.load_state([(first, tensors[first])])              # one tensor of many
    assert model.weights_stale()
    model.load_state(sorted(tensors.items()))
    assert not model.weights_stale()


def test_retracted_requests_held_across_a_dropping_release_fail_with_the_reason(tiny):
    """A request held by a pause (retracted ones wait in the same queue) while the weights are
    dropped and resumed without a push is answered with the reason, not run on uninitialised memory."""
    model = _model(tiny)
    eng = Engine(model, max_running=2, max_len=64)
    eng.start()
    try:
        eng.control(lambda: eng.pause("retract")).result(timeout=60)
        req = Request(list(PROMPT), Sampling(max_new_tokens=8, temperature=0.0))
        fut = eng.submit_many([req])[0]          # held in the queue while paused, as retracted ones are
        eng.control(lambda: (model.offload_weights(keep=False), model.reload_weights())).result(timeout=60)
        eng.control(eng.unpause).result(timeout=60)
        with pytest.raises(RuntimeError, match="enable-weights-cpu-backup"):
            fut.result(timeout=60)
    finally:
        eng.stop()


def test_kept_weights_come_back_unchanged_through_one_reused_host_buffer(tiny):
    model = _model(tiny)
    reference = {n: p.clone() for n, p in model.params.items()}
    model.offload_weights(keep=True)
    host = model._host_copy
    model.reload_weights()
    assert not model.weights_stale()
    for n, p in model.params.items():
        assert torch.equal(p, reference[n]), n
    model.offload_weights(keep=True)
    assert model._host_copy is host          # made once, reused by every later release
    model.reload_weights()
    eng = Engine(model, max_running=2, max_len=64)
    eng.start()
    try:
        kept = _greedy(eng)
    finally:
        eng.stop()
    fresh = Engine(_model(tiny), max_running=2, max_len=64)
    fresh.start()
    try:
        assert kept == _greedy(fresh)
    finally:
        fresh.stop()


class _PoisoningRegion:
    """The model's side of a stable region on CPU: the same address for the region's life, and on
    release its bytes overwritten (what unmapped-then-remapped pages hold is undefined), so only
    what the model restores itself comes back. The driver side (pages freed, the address kept,
    graphs replayed) is held by tests_gpu/test_stable_memory.py on a GPU."""

    def __init__(self, nbytes: int, device):
        self.nbytes = nbytes
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8)
        self.mapped = True
        self.closed = False

    def release(self) -> None:
        self.tensor.fill_(0xFF)          # a NaN in every float weight, garbage in the cache
        self.mapped = False

    def restore(self) -> None:
        self.mapped = True

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def stable_engine(tiny, monkeypatch):
    """A running engine whose model keeps its weights and cache in (CPU stand-in) stable regions."""
    import megarl.engine.model as model_module
    monkeypatch.setattr(model_module, "stable_memory_available", lambda device: True)
    monkeypatch.setattr(model_module, "StableRegion", _PoisoningRegion)
    model = _model(tiny)
    eng = Engine(model, max_running=2, max_len=64)
    eng.start()
    try:
        yield model, eng
    finally:
        eng.stop()


def test_weights_and_cache_in_stable_regions_keep_their_addresses_and_serve_as_before(tiny, stable_engine):
    model, eng = stable_engine
    before = _greedy(eng)
    addresses = model.tensor_addresses()

    def cycle(keep: bool) -> None:
        model.offload_weights(keep=keep)
        model.free_cache()
        assert not model._weights_region.mapped and not model._cache_region.mapped
        with pytest.raises(RuntimeError, match="resume them before updating"):
            model.load_hf_dir(tiny)
        model.reload_weights()
        model.alloc_cache(eng.max_running, eng.max_len)
    eng.control(lambda: cycle(True)).result(timeout=60)
    assert model.tensor_addresses() == addresses and not model.weights_stale()
    assert _greedy(eng) == before                    # restored from the host copy, cache zeroed
    eng.control(lambda: cycle(False)).result(timeout=60)
    assert model.tensor_addresses() == addresses and model.weights_stale()
    with pytest.raises(RuntimeError, match="enable-weights-cpu-backup"):
        _greedy(eng)
    model.load_hf_dir(tiny)
    assert _greedy(eng) == before
    region = model._cache_region
    eng.control(lambda: model.alloc_cache(eng.max_running, 32)).result(timeout=60)
    assert region.closed and model._cache_region is not region   # another size: a new region


def test_requests_held_across_a_release_wait_for_the_resume_and_no_forward_reads_released_weights(
        stable_engine):
    """pause(retract) -> release -> continue -> resume, as a client may order them: the held
    request is admitted only after the resume (with stable regions, a forward before it would read
    unmapped pages -- on a GPU the CUDA context is lost; here the poisoned bytes give other tokens),
    and any forward on released weights is refused."""
    model, eng = stable_engine
    before = _greedy(eng)
    eng.control(lambda: eng.pause("retract")).result(timeout=60)
    held = eng.submit_many([Request(list(PROMPT), Sampling(max_new_tokens=8, temperature=0.0))])[0]

    def release() -> None:
        model.offload_weights(keep=True)
        model.free_cache()
        eng.released.update({"weights", "kv_cache"})

    def resume() -> None:
        model.reload_weights()
        model.alloc_cache(eng.max_running, eng.max_len)
        eng.released.clear()
    eng.control(release).result(timeout=60)
    eng.control(eng.unpause).result(timeout=60)     # continue before resume: the loop admits now
    with pytest.raises(RuntimeError, match="resume them before generating"):
        eng.control(lambda: model.prefill([list(PROMPT)], 0)).result(timeout=60)
    assert not held.done()
    eng.control(resume).result(timeout=60)
    assert held.result(timeout=120)["output_ids"] == before


def _cfg(recipe: str, *overrides: str):
    from megarl.config import load_config
    return load_config(ROOT / "recipes" / recipe, list(overrides))


@pytest.mark.parametrize("recipe, overrides, backup", [
    ("qwen2.5-7b-grpo-1gpu.yaml", (), False),                    # every release is followed by a full push
    ("llama3.1-8b-ppo.yaml", (), True),                          # reward model: released inside the rollout
    ("qwen2.5-7b-lora-grpo.yaml", ("actor.lora.push=adapter",), True),   # the base is never pushed
    ("qwen2.5-7b-lora-grpo.yaml", ("actor.lora.push=merged",), False),
])
def test_servers_keep_a_host_copy_exactly_where_weights_resume_unpushed(recipe, overrides, backup):
    from megarl.config.colocation import released_weights_resume_unpushed
    from megarl.engine.cli import build_parser
    from megarl.rollout.launch import LaunchSpec, embedded_args, sglang_args

    cfg = _cfg(recipe, *overrides)
    assert released_weights_resume_unpushed(cfg) is backup
    spec = LaunchSpec(0, "127.0.0.1", 30000)
    assert ("--enable-weights-cpu-backup" in sglang_args(cfg, Path("/models/x"), spec)) is backup
    embedded = embedded_args(cfg, Path("/models/x"), spec, Path("/tmp/w"))
    assert ("--enable-weights-cpu-backup" in embedded) is backup
    assert build_parser().parse_args(embedded).enable_weights_cpu_backup is backup   # the engine's own parser
