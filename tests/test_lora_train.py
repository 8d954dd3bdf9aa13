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
