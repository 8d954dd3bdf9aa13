"""LoRA GRPO end to end (Trainer, embedded server): the reference is the actor's base (KL exactly 0
before the first update, no reference role built), merged pushes put the adapted weights on the
server (its rollout logprobs equal the trainer's), and the export writes a merged HF model and a
PEFT adapter that ``peft`` loads onto the base model with the same logits."""
from __future__ import annotations

import pytest
import torch

from megarl.trainer import Trainer
from tests.helpers.runs import tiny_model, tiny_run_config


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("models"))


def test_lora_grpo_refs_the_base_pushes_merged_and_exports_peft(model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = tiny_run_config(model, tmp_path / "run", "actor.lora.rank=4", "actor.lora.alpha=8", "actor.optim.lr=2e-2",
                          "ref.enabled=true", "algorithm.kl.mode=loss", "algorithm.kl.coef=0.01",
                          "trainer.eval_before_after=false")
    trainer = Trainer(cfg)
    results = trainer.run()
    steps = results["steps"]
    assert len(steps) == 3
    assert steps[0]["kl/actor_ref_k1"] == 0.0, "before any update the actor is its base model"
    assert steps[-1]["kl/actor_ref_k1"] != 0.0, "the adapters did not move the policy away from the base"
    # the server samples from the merged weights of every push (the trainer's own logprobs)
    assert max(m["rollout/logprob_diff_max"] for m in steps) < 1e-4
    assert steps[-1]["sync/bytes"] > 1e6     # merged mode pushes the whole model
    ids = torch.tensor([[1, 20, 300, 4000, 50]])
    merged = AutoModelForCausalLM.from_pretrained(results["export"]).eval()
    base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "run" / "hf_adapter")).eval()
    with torch.no_grad():
        a, m = adapted(ids).logits, merged(ids).logits
        start = AutoModelForCausalLM.from_pretrained(str(model)).eval()(ids).logits
    assert (m - start).abs().max() > 1e-4, "the export is the untrained model"
    assert (a - m).abs().max() < 1e-4
    # the final checkpoint holds the adapters only; `megarl convert lora-to-peft` rebuilds both exports
    from safetensors.torch import load_file

    from megarl.checkpoint.cli import convert_main

    ckpt = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1]
    assert convert_main(["lora-to-peft", "--ckpt", str(ckpt), "--out", str(tmp_path / "peft"),
                         "--merged", str(tmp_path / "merged")]) == 0
    exported = load_file(str(tmp_path / "run" / "hf_adapter" / "adapter_model.safetensors"))
    converted = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert exported.keys() == converted.keys() and all(torch.equal(exported[k], converted[k]) for k in exported)
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, m)
    assert convert_main(["lora-to-peft", "--ckpt", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 1


def test_lora_grpo_with_adapter_only_pushes(model, tmp_path):
    """``actor.lora.push: adapter`` on the embedded server: the servers keep the base and each push
    loads only the adapters (PEFT-named tensors through ``/load_lora_adapter_from_tensors``); every
    rollout runs the newest adapter: the step-0 check and every later step's rollout logprobs equal
    the trainer's, and the push moves the adapters' bytes, not the model's."""
    from megarl.sync.adapter import adapter_name

    cfg = tiny_run_config(model, tmp_path / "run", "actor.lora.rank=4", "actor.lora.alpha=8", "actor.optim.lr=2e-2",
                          "actor.lora.push=adapter", "trainer.total_steps=2", "trainer.eval_before_after=false",
                          "checkpoint.export_hf=false", "checkpoint.final=false")
    trainer = Trainer(cfg)
    steps = trainer.run()["steps"]
    assert len(steps) == 2
    # step 0 ran adapter "init" (B = 0), step 1 the adapter after one update: the server's logprobs
    # are the trainer's only if that adapter arrived and the requests named it
    assert max(m["rollout/logprob_diff_max"] for m in steps) < 1e-4
    assert 0 < steps[-1]["sync/bytes"] < 2e5, steps[-1]["sync/bytes"]   # the adapters, not the model (~1 MB)
    assert trainer.servers.lora_name == adapter_name("step2")
    assert trainer.weights.adapters.current == adapter_name("step2")
