"""A 2-step GRPO run of the calculator recipe on CPU: real megatron actor, real embedded rollout
server, real calculator tool -- with a tiny random model, so most turns are made tool calls
(``mostly_call`` parser) and the reward is shaped (random models never answer right). At step 0
the trainer's logprobs of the model's tokens must match the server's: that holds only if the
interleaved trajectory reaches the trainer token for token and the environment tokens are left
out of the comparison and the loss."""
from __future__ import annotations

from megarl.config import load_config
from megarl.trainer import Trainer
from tests.helpers.runs import ROOT, tiny_agent_overrides, tiny_model

RECIPE = ROOT / "recipes" / "smollm2-135m-calculator-cpu.yaml"


def test_calculator_recipe_two_grpo_steps(tmp_path):
    model = tiny_model(tmp_path / "models")
    cfg = load_config(RECIPE, tiny_agent_overrides(
        model, tmp_path / "run", "trainer.total_steps=2", "agent.env=tests.helpers.agent:DistinctCalcEnv",
        "agent.max_turns=3"))
    results = Trainer(cfg).run()
    steps = results["steps"]
    assert len(steps) == 2
    for m in steps:
        assert m["agent/turns_mean"] > 1.3 and m["agent/turns_max"] == 3   # multi-turn trajectories
        assert m["agent/tool_calls_per_traj"] >= 1 and m["agent/tool_call_success_frac"] == 1.0
        assert 0 < m["agent/env_token_frac"] < 1
        assert m["rollout/logprob_diff_mean"] < 1e-4        # model tokens only, aligned bit for bit
        assert m["batch/response_tokens"] < m["batch/samples"] * cfg.agent.max_response_tokens
    assert any(abs(m["actor/grad_norm"]) > 0 for m in steps)
