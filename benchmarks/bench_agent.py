"""Agent-loop rollout throughput on CPU (one JSON line): trajectories/s and tokens/s for 1-, 4- and
8-turn calculator trajectories against a real embedded rollout server, and the fraction of
rollout time spent outside generation (environment steps, tool calls, decoding, parsing,
observation tokenisation).

    python benchmarks/bench_agent.py [--model tiny|smollm2] [--trajectories 16] [--new 32] [--threads 2]

Every model turn is a fixed ``--new`` tokens (no stop tokens), so the shape does not depend on what
a random or real model happens to write: turns 1..k-1 call the calculator (the real tool, through
the tool pool and the trajectory's chat-template tokenisation), turn k is the answer. ``tiny`` is a
random 2-layer model with SmolLM2's tokenizer (generation is nearly free, the worst case for the
outside-generation fraction); ``smollm2`` is the real 135M model.

Fraction outside generation = (time in environments + tokenisation) / wall time of the
trajectories, both summed over trajectories (HTTP round trips count as generation: they are inside
the /generate await).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megarl.envs.base import Action, StepResult, ToolCall  # noqa: E402
from megarl.envs.calculator import CalculatorEnv  # noqa: E402
from megarl.envs.registry import register_env  # noqa: E402


@register_env("bench_fixed_turns")
class FixedTurnsCalc(CalculatorEnv):
    """The calculator env with a fixed number of turns: every turn before the last is a tool call."""

    async def step(self, action: Action) -> StepResult:
        self.turn = getattr(self, "turn", 0) + 1
        if self.turn < int(self.ctx.args["turns"]):
            expr = f"{len(action.text) + 12345} * {self.turn + 6789} / 7"
            return await super().step(Action(action.text, [ToolCall("calculator", {"expression": expr})]))
        return await super().step(Action(action.text))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    ap.add_argument("--trajectories", type=int, default=16)
    ap.add_argument("--turns", default="1,4,8")
    ap.add_argument("--new", type=int, default=32, help="tokens per model turn")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="auto", help="embedded server device: cpu | cuda | auto")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from megarl.data.records import PromptRecord
    from megarl.checkpoint.smollm2 import smollm2_hf_dir
    from megarl.rollout.agent import AgentRollout, AgentSettings
    from megarl.rollout.manager import RolloutManager
    from tests.helpers.servers import ServerProcess
    from tests.helpers.models import make_tiny_chat_model

    path = str(smollm2_hf_dir()) if a.model == "smollm2" else str(make_tiny_chat_model(
        os.path.join(tempfile.gettempdir(), "megarl_bench_agent_tiny")))
    tok = AutoTokenizer.from_pretrained(path)
    records = [PromptRecord(f"What is {i * 7919} times {i + 13}?", answer=str(i * 7919 * (i + 13)), index=i)
               for i in range(a.trajectories)]
    sampling = {"max_new_tokens": a.new, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop_token_ids": []}
    rows = []
    with ServerProcess(path, threads=a.threads, extra=["--max-running-requests", str(max(64, a.trajectories)),
                                                            "--device", a.device]) as srv:
        manager = RolloutManager([srv.url], max_concurrency=max(64, a.trajectories), timeout_s=600)
        try:
            for turns in [int(t) for t in a.turns.split(",")]:
                settings = AgentSettings("bench_fixed_turns", {"turns": turns}, max_turns=turns,
                                         max_response_tokens=turns * (a.new + 400))
                rollout = AgentRollout(manager, sampling, tok, settings)
                rollout.generate(records[:2], 1, seed_base=1)          # warm-up (server, template cache)
                rollout.clock.__init__()
                t = time.perf_counter()
                samples = rollout.generate(records, 1, seed_base=7)
                wall = time.perf_counter() - t
                c = rollout.clock
                model_tokens = sum(sum(s.loss_mask) for s in samples)
                all_tokens = sum(len(s.response_ids) for s in samples)
                assert all(s.info["turns"] == turns for s in samples), [s.info for s in samples]
                rows.append({"turns": turns, "trajectories": len(samples), "wall_s": round(wall, 3),
                             "trajectories_per_s": round(len(samples) / wall, 3),
                             "model_tokens_per_s": round(model_tokens / wall, 1),
                             "response_tokens_per_s": round(all_tokens / wall, 1),
                             "env_tokens_frac": round(1 - model_tokens / all_tokens, 3),
                             "outside_generation_frac": round((c.env_s + c.tokenize_s) / c.trajectory_s, 4),
                             "env_s": round(c.env_s, 4), "tokenize_s": round(c.tokenize_s, 4),
                             "generate_s": round(c.generate_s, 3), "trajectory_s": round(c.trajectory_s, 3)})
                rollout.close()
        finally:
            manager.close()
    print(json.dumps({"bench": "agent", "env": "calculator", "model": a.model, "device": a.device, "new_tokens_per_turn": a.new,
                      "threads": a.threads, "rows": rows}), flush=True)


if __name__ == "__main__":
    main()
