"""Token-in-token-out: the trainer's input ids of every trajectory are the server's tokens
interleaved with the tokenised observations, bit for bit, and the loss mask covers exactly the
server's tokens -- over random turn structures (calls, malformed calls, unknown tools, answers,
turns cut by length, turn and token limits), with model tokens that are deliberately NOT the
canonical encoding of their text, so any decode -> re-encode on the way would show.

The reference for the environment's tokens is written by hand from the ChatML format SmolLM2's
template uses (``<|im_start|>tool\\n...<|im_end|>\\n<|im_start|>assistant\\n``), not taken from
the code under test; observations are checked against exact arithmetic done here.
"""
from __future__ import annotations

import asyncio
import json
import random
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from megarl.data.batch import LOSS_MASK
from megarl.data.records import PromptRecord
from megarl.rollout.agent import AgentRollout, AgentSettings, agent_metrics
from megarl.rollout.sample import token_batch
from megarl.workers.batch import packed_inputs, padded_inputs
from tests.helpers.agent import ScriptedServer

EOS = 2   # <|im_end|> in SmolLM2's tokenizer


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from megarl.checkpoint.smollm2 import smollm2_hf_dir

    return AutoTokenizer.from_pretrained(str(smollm2_hf_dir()))


def char_split(tok, text: str) -> list[int]:
    """Token ids of ``text`` one character at a time: decodes to ``text`` but is not how the
    tokenizer would encode it (what a sampling model may well produce)."""
    return [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]


def random_turn(tok, rng: random.Random) -> tuple[list[int], str, dict]:
    """One scripted model turn: (ids, finish_reason, what the environment should answer)."""
    kind = rng.choice(["call", "call", "call2", "bad_json", "unknown", "bad_args", "answer", "cut"])
    a, b = rng.randint(10, 10**6), rng.randint(2, 999)
    if kind in ("call", "call2"):
        exprs = [f"{a} * {b}"] + ([f"{b} - {a} / 4"] if kind == "call2" else [])
        text = "Let me compute. " + "".join(
            f'<tool_call>{json.dumps({"name": "calculator", "arguments": {"expression": e}})}</tool_call>' for e in exprs)
        values = [a * b] + ([Fraction(b) - Fraction(a, 4)] if kind == "call2" else [])
        want = {"kind": "obs", "contents": [_fmt(v) for v in values]}
    elif kind == "bad_json":
        text = '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
        want = {"kind": "obs", "prefix": ["Error: tool call is not valid JSON"]}
    elif kind == "unknown":
        text = '<tool_call>{"name": "wolfram", "arguments": {"q": "1"}}</tool_call>'
        want = {"kind": "obs", "prefix": ["Error: unknown tool 'wolfram'"]}
    elif kind == "bad_args":
        text = '<tool_call>{"name": "calculator", "arguments": {"expr": "1+1"}}</tool_call>'
        want = {"kind": "obs", "prefix": ["Error: bad arguments for calculator"]}
    else:
        text = f"The answer is {a}."
        want = {"kind": "done"}
    ids = char_split(tok, text) if rng.random() < 0.7 else tok.encode(text, add_special_tokens=False)
    ids = ids + [rng.randint(300, 40000) for _ in range(rng.randint(0, 3))] if kind != "answer" and rng.random() < 0.3 else ids
    if kind == "cut":
        return ids, "length", {"kind": "done"}
    return ids + [EOS], "stop", want


def _fmt(v) -> str:
    v = Fraction(v)
    return str(v.numerator) if v.denominator == 1 else f"{v.numerator}/{v.denominator} (= {float(v):.12g})"


def chatml_tool_turns(contents: list[str], model_closed_turn: bool) -> str:
    """The environment's text between two assistant turns, by hand, for ChatML."""
    body = "".join(f"<|im_start|>tool\n{c}<|im_end|>\n" for c in contents)
    return ("\n" if model_closed_turn else "<|im_end|>\n") + body + "<|im_start|>assistant\n"


def run_batch(tok, scripts, settings, records, delay_s=0.0):
    server = ScriptedServer(scripts, delay_s)
    sampling = {"max_new_tokens": 400, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop_token_ids": [EOS]}
    rollout = AgentRollout(server, sampling, tok, settings)
    try:
        samples = asyncio.run(rollout._batch(records, 1, 7, sampling))
    finally:
        rollout.close()
    return server, samples


@pytest.mark.parametrize("seed", range(3))
def test_trainer_ids_are_server_tokens_interleaved_with_observations(tok, seed):
    rng = random.Random(seed)
    n_traj, max_turns = 12, 5
    scripts, wants = {}, {}
    for j in range(n_traj):
        turns = [random_turn(tok, rng) for _ in range(rng.randint(0, 6))]
        turns.append((tok.encode("The answer is 1.", add_special_tokens=False) + [EOS], "stop", {"kind": "done"}))
        scripts[j] = [(ids, fin) for ids, fin, _ in turns]
        wants[j] = [w for _, _, w in turns]
    budget = 300 if seed == 0 else 4000     # seed 0: the token budget cuts turns and trajectories
    settings = AgentSettings("calculator", max_turns=max_turns, max_response_tokens=budget)
    records = [PromptRecord(f"What is {j} + 1?", answer=str(j + 1), index=j) for j in range(n_traj)]
    server, samples = run_batch(tok, scripts, settings, records)

    reencode_differs = 0
    for j, s in enumerate(samples):
        from megarl.envs.calculator import CalculatorEnv

        opening = ([{"role": "system", "content": settings_system()}] + CalculatorEnv.EXAMPLE
                   + [{"role": "user", "content": records[j].prompt}])   # the worked example (env_args.example)
        want_prompt = tok.apply_chat_template(opening, add_generation_prompt=True, tokenize=True)
        assert s.prompt_ids == list(want_prompt["input_ids"] if hasattr(want_prompt, "keys") else want_prompt)
        pos = 0
        expect_mask: list[int] = []
        for t, (inp, out, lps) in enumerate(server.log[j]):
            # the server saw exactly the trajectory so far, and its tokens went in verbatim
            assert inp == s.prompt_ids + s.response_ids[:pos]
            assert s.response_ids[pos:pos + len(out)] == out
            assert s.rollout_logprobs[pos:pos + len(out)] == lps
            expect_mask += [1] * len(out)
            text = tok.decode(out, skip_special_tokens=True)
            reencode_differs += tok.encode(text, add_special_tokens=False) != [i for i in out if i != EOS]
            pos += len(out)
            nxt = pos + (len(server.log[j][t + 1][0]) - len(inp) - len(out) if t + 1 < len(server.log[j]) else
                         len(s.response_ids) - pos)
            env = s.response_ids[pos:nxt]
            assert s.rollout_logprobs[pos:nxt] == [0.0] * len(env)
            if t + 1 < len(server.log[j]):
                want = wants[j][t]
                closed = bool(out) and out[-1] == EOS
                env_text = tok.decode(env, skip_special_tokens=False)
                if "contents" in want:
                    assert env_text == chatml_tool_turns(want["contents"], closed)
                else:
                    head = ("\n" if closed else "<|im_end|>\n") + "<|im_start|>tool\nError: "
                    assert env_text.startswith(head) and want["prefix"][0][len("Error: "):] in env_text
                    assert env_text.endswith("<|im_end|>\n<|im_start|>assistant\n")
                assert env == tok.encode(env_text, add_special_tokens=False)
            expect_mask += [0] * len(env)
            pos = nxt
        assert pos == len(s.response_ids)
        assert s.loss_mask == expect_mask
        assert len(s.response_ids) <= budget
        assert s.info["turns"] == len(server.log[j]) <= max_turns
    assert reencode_differs > 0   # re-encoding the text would have changed the tokens
    assert max(s.info["turns"] for s in samples) >= 3 and sum(s.info["env_tokens"] > 0 for s in samples) >= n_traj // 2

    # the flat batch the workers get: same ids, the loss mask as a token field, the losses' mask
    batch = token_batch(samples)
    for i, s in enumerate(samples):
        assert batch.sequence(i).tolist() == s.prompt_ids + s.response_ids
    assert batch.token_fields[LOSS_MASK].tolist() == [float(m) for s in samples for m in s.loss_mask]
    lm = batch.loss_mask()
    for i, s in enumerate(samples):
        assert lm[i, :len(s.loss_mask)].tolist() == [float(m) for m in s.loss_mask]
        assert lm[i, len(s.loss_mask):].sum() == 0
    for inputs in (packed_inputs(batch), padded_inputs(batch)):
        assert torch.equal(inputs.loss_mask, lm)
        # the row predicting each model token holds the token before it, in the same sequence
        flat = inputs.input_ids.reshape(-1)
        for i, s in enumerate(samples):
            for k, m in enumerate(s.loss_mask):
                if m:
                    row = int(inputs.pred_index[i, k])
                    assert int(inputs.next_ids[row]) == s.response_ids[k]
                    assert int(flat[row]) == (s.prompt_ids + s.response_ids)[len(s.prompt_ids) + k - 1]
    metrics = agent_metrics(samples)
    assert metrics["agent/turns_mean"] == sum(len(server.log[j]) for j in range(n_traj)) / n_traj
    # independent count from the scripts: calls the parser finds, and which of them fail (every
    # generated turn went to the environment, the last one of a truncated trajectory too)
    answered = [[w for t, w in enumerate(wants[j][:len(server.log[j])])
                 if len(server.log[j][t][1]) == len(scripts[j][t][0])]        # not cut by the token budget
                for j in range(n_traj)]
    cut = sum(len(server.log[j][t][1]) < len(scripts[j][t][0]) for j in range(n_traj) for t in range(len(server.log[j])))
    calls = sum(len(w.get("contents", [])) + (w.get("prefix", [""])[0].startswith(("Error: unknown", "Error: bad")))
                for ws in answered for w in ws)
    failed = sum(w.get("prefix", [""])[0].startswith(("Error: unknown", "Error: bad")) for ws in answered for w in ws)
    assert (cut > 0) == (seed == 0)
    if cut == 0:
        assert metrics["agent/tool_calls_per_traj"] * n_traj == pytest.approx(calls)
        assert metrics["agent/tool_call_success_frac"] == pytest.approx((calls - failed) / calls if calls else 0.0)


def settings_system() -> str:
    from megarl.envs.calculator import CALCULATOR, CalculatorEnv
    from megarl.envs.tool_env import tool_prompt

    return tool_prompt([CALCULATOR], CalculatorEnv.INTRO)


def test_malformed_calls_give_error_observations_and_the_model_can_recover(tok):
    bad = ['<tool_call>{"name": "calculator", "arguments": {"expression": "2*"}}</tool_call>',   # tool raises
           '<tool_call>not json</tool_call>', '<tool_call>["calculator"]</tool_call>',
           '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": "calculator", "arguments": "{x"}</tool_call>',
           '<tool_call>{"name": "calculator"', '<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}</tool_call>']
    scripts = {j: [(tok.encode(b, add_special_tokens=False) + [EOS], "stop"),
                   (tok.encode("The answer is 5.", add_special_tokens=False) + [EOS], "stop")] for j, b in enumerate(bad)}
    records = [PromptRecord("What is 2 + 3?", answer="5", index=j) for j in range(len(bad))]
    server, samples = run_batch(tok, scripts, AgentSettings("calculator", max_turns=3, max_response_tokens=1000), records)
    for j, s in enumerate(samples):
        env = [t for t, m in zip(s.response_ids, s.loss_mask) if not m]
        text = tok.decode(env, skip_special_tokens=False)
        assert "<|im_start|>tool\nError: " in text, (bad[j], text)
        assert s.reward == 1.0 and s.info["turns"] == 2 and s.info["tool_errors"] >= 1 and not s.info["truncated"]


def test_an_opening_longer_than_max_prompt_len_is_a_clear_error(tok):
    """The servers' context is max_prompt_len + agent.max_response_tokens: an opening (system prompt,
    worked example, question) that does not fit is refused before any request, naming the field."""
    settings = AgentSettings("calculator", max_turns=2, max_response_tokens=100, max_prompt_len=64)
    with pytest.raises(ValueError, match=r"rollout.max_prompt_len: an opening conversation of environment "
                                         r"'calculator' .* is \d+ tokens, more than 64"):
        run_batch(tok, {0: [(tok.encode("7", add_special_tokens=False) + [EOS], "stop")]}, settings,
                  [PromptRecord("What is 3 + 4?", answer="7", index=0)])
    settings.max_prompt_len = 4096
    server, (sample,) = run_batch(tok, {0: [(tok.encode("7", add_special_tokens=False) + [EOS], "stop")]}, settings,
                                  [PromptRecord("What is 3 + 4?", answer="7", index=0)])
    assert sample.reward == 1.0 and len(server.log[0]) == 1
