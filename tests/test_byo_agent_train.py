"""A 3-step GRPO run of the bring-your-own-agent recipe on CPU: real megatron actor, real embedded
rollout server, the recipe's own agent (``recipes/agents/openai_calculator.py``, plain ``openai``
package) calling the gateway -- with a tiny random model (SmolLM2's tokenizer and template) so the
steps take seconds, and the ``mostly_call`` parser so that its turns become tool calls the agent
runs (a random model never writes one): trajectories are multi-turn, and since SmolLM2's template
renders the returned tool calls differently from the sampled tokens, every continued call is
spliced. At step 0 the trainer's logprobs of the sampled tokens must match the server's
(the fidelity gate): that holds only if the recorded sequences are the server's tokens, token for
token, with the template and tool tokens left out of the comparison and the loss."""
from __future__ import annotations

import pytest

from megarl.config import load_config
from megarl.trainer import Trainer
from tests.helpers.runs import ROOT, tiny_agent_overrides, tiny_model

pytestmark = pytest.mark.e2e
RECIPE = ROOT / "recipes" / "smollm2-135m-grpo-byo-agent-cpu.yaml"


def test_byo_agent_recipe_three_grpo_steps(tmp_path):
    model = tiny_model(tmp_path / "models")
    cfg = load_config(RECIPE, tiny_agent_overrides(
        model, tmp_path / "run", "trainer.total_steps=3", "reward.kind=function",
        "reward.function=tests.helpers.rewards:distinct_token_reward"))
    trainer = Trainer(cfg)
    results = trainer.run()
    steps = results["steps"]
    assert len(steps) == 3
    for m in steps:
        assert m["agent/turns_mean"] > 1.3 and m["agent/turns_max"] == 3        # multi-turn trajectories
        assert m["agent/tool_calls_per_traj"] >= 1
        assert 0 < m["agent/env_token_frac"] < 1
        assert m["reward/failed_frac"] == 0.0
    assert steps[0]["rollout/logprob_diff_mean"] < 1e-4    # the step-0 gate (enforced by the trainer too)
    assert any(abs(m["actor/grad_norm"]) > 0 for m in steps)
    joins = [j for session in trainer.rollout.agent.sessions for j in session.joins]
    assert joins.count("new") == len(trainer.rollout.agent.sessions) and "splice" in joins   # one segment each
