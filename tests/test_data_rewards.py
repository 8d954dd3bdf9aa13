"""Prompt data sources, resumable loader, chat templates, and rule / reasoning-gym / user rewards."""
from __future__ import annotations

import json

import pytest

from megarl.data import DataError, PromptLoader, encode_prompt, load_jsonl, load_parquet, load_reasoning_gym, load_split
from megarl.rewards import extract_answer, load_user_function, math_answer_reward, reasoning_gym_reward


def test_jsonl_errors_name_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": 1}\n{"prompt": "b"\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: invalid JSON"):
        load_jsonl(path)
    path.write_text('{"question": "a"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:1: no field 'prompt' \(data.prompt_key\)"):
        load_jsonl(path)
    path.write_text('{"prompt": [{"role": "user", "content": "hi"}], "answer": "3", "id": 7}\n')
    (record,) = load_jsonl(path)
    assert record.prompt[0]["content"] == "hi" and record.answer == "3" and record.metadata == {"id": 7}


def test_parquet_roundtrip(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"q": ["1+1", "2+2"], "a": ["2", "4"]}), tmp_path / "d.parquet")
    records = load_parquet(tmp_path / "d.parquet", prompt_key="q", answer_key="a")
    assert [(r.prompt, r.answer) for r in records] == [("1+1", "2"), ("2+2", "4")]


def test_loader_is_deterministic_and_resumes_exactly():
    records = load_reasoning_gym("basic_arithmetic", 10, seed=3)
    a = PromptLoader(records, 4, seed=1)
    seq_a = [[r.index for r in a.next_batch()] for _ in range(6)]  # crosses two epoch boundaries
    b = PromptLoader(records, 4, seed=1)
    for _ in range(2):
        b.next_batch()
    state = json.loads(json.dumps(b.state_dict()))
    c = PromptLoader(records, 4, seed=999)
    c.load_state_dict(state)
    assert [[r.index for r in c.next_batch()] for _ in range(4)] == seq_a[2:]
    assert sorted(sum(seq_a[:2], [])[:8] + seq_a[2][:2]) == list(range(10))  # epoch 0 is a permutation
    with pytest.raises(ValueError, match="data changed"):
        PromptLoader(records[:5], 4, seed=1).load_state_dict(state)


def test_eval_split_never_repeats_train_prompts():
    from megarl.config.schema import DataConfig

    cfg = DataConfig(source="reasoning_gym", task="basic_arithmetic", num_train=200, num_eval=50)
    train = {r.prompt for r in load_split(cfg, 5, "train")}
    held_out = load_split(cfg, 5, "eval")
    assert held_out and not train & {r.prompt for r in held_out}


def test_chat_template_of_the_real_tokenizer():
    from megarl.data.records import PromptRecord
    from megarl.workers.model_source import load_tokenizer

    tok = load_tokenizer("builtin:smollm2-135m-instruct")
    ids = encode_prompt(tok, PromptRecord("What is 2+2?"), chat_template=True, system_prompt="Be brief.")
    text = tok.decode(ids)
    assert text.index("Be brief.") < text.index("What is 2+2?")
    assert text.rstrip().endswith("<|im_start|>assistant")


@pytest.mark.parametrize("response,reference,expected", [
    ("so the answer is \\boxed{\\frac{1}{2}}", "1/2", 1.0),
    ("\\boxed{0.5}", "1/2", 1.0),
    ("... #### 1,234", "Natalia sold... #### 1234", 1.0),
    ("<answer>42</answer>", "42", 1.0),
    ("I think 41 or maybe 42", "42", 1.0),
    ("I think 42 or maybe 41", "42", 0.0),
    ("no number here", "3", 0.0),
    ("\\boxed{x+1}", "x+1", 1.0),
])
def test_math_answer_reward(response, reference, expected):
    assert math_answer_reward(response, reference) == expected


def test_extract_answer_prefers_boxed():
    assert extract_answer("first 3 then \\boxed{7} and 9") == "7"


def test_reasoning_gym_reward_uses_the_task_scorer():
    (record,) = load_reasoning_gym("basic_arithmetic", 1, seed=11)
    assert reasoning_gym_reward(f" {record.answer}\n", record) == 1.0
    assert reasoning_gym_reward("banana", record) == 0.0
    assert 0.0 < reasoning_gym_reward(f"The answer is {record.answer}", record) < 1.0  # partial credit


def test_user_reward_function_errors():
    fn = load_user_function("tests.helpers.rewards:distinct_token_reward")
    assert fn("aab", None) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="cannot import"):
        load_user_function("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="no callable 'nope'"):
        load_user_function("tests.helpers.rewards:nope")
