"""``megarl data prepare``: small fixtures in the public datasets' exact on-disk schemas (column
names and types, nesting, folder layouts) become files ``megarl train`` accepts, with the answers
the rule reward scores; wrong input is one line naming the file."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.config import load_config, validate_config
from megarl.data.prepare import DATASETS, generic_record, parse_map, prepare
from megarl.data.sources import DataError, load_jsonl, load_parquet
from megarl.rewards.rules import math_answer_reward
from tests.helpers.runs import DEFAULT, tiny_model, tiny_overrides
from tests.test_cli_errors import megarl, one_error_line

GSM8K = [{"question": f"Tom has {n} apples and buys {n} more. How many now?",
          "answer": f"He has {n} + {n} = <<{n}+{n}={2 * n}>>{2 * n} apples.\n#### {2 * n:,}"} for n in (3, 40, 600, 900)]
MATH_ROWS = [
    {"problem": "What is $\\frac{1}{2}+\\frac{1}{4}$?", "level": "Level 1", "type": "Prealgebra",
     "solution": "We add: $\\frac{1}{2}+\\frac{1}{4}=\\boxed{\\frac{3}{4}}$."},
    {"problem": "Simplify $\\sqrt{16}$.", "level": "Level 2", "type": "Algebra",
     "solution": "Since $4^2=16$, the answer is $\\boxed{4}$."},
    {"problem": "Find $x$ if $x^2=\\{9\\}$.", "level": "Level 3", "type": "Algebra",
     "solution": "So $x=\\boxed{\\{-3, 3\\}}$ in set notation."},
]


def write_parquet(path: Path, rows: list[dict], schema: pa.Schema | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_hugging_face_layout_keeps_the_test_split_and_the_final_answers(tmp_path):
    write_parquet(tmp_path / "main" / "train-00000-of-00001.parquet", GSM8K[:3])
    write_parquet(tmp_path / "main" / "test-00000-of-00001.parquet", GSM8K[3:])
    write_parquet(tmp_path / "socratic" / "train-00000-of-00001.parquet", GSM8K)   # another config: not read
    out = prepare(DATASETS["gsm8k"], tmp_path)
    assert [r["answer"] for r in out.train] == ["6", "80", "1200"] and [r["answer"] for r in out.eval] == ["1800"]
    first = out.train[0]["prompt"]
    assert first[0]["role"] == "user" and first[0]["content"].startswith(GSM8K[0]["question"])
    assert '"####"' in first[0]["content"]
    # the reward scores a response in the format the instruction asks for against the prepared answer
    assert math_answer_reward("3 + 3 = 6\n#### 6", out.train[0]["answer"]) == 1.0


def test_gsm8k_original_jsonl_layout(tmp_path):
    write_jsonl(tmp_path / "grade_school_math" / "data" / "train.jsonl", GSM8K[:2])
    write_jsonl(tmp_path / "grade_school_math" / "data" / "test.jsonl", GSM8K[2:])
    out = prepare(DATASETS["gsm8k"], tmp_path)
    assert len(out.train) == 2 and [r["answer"] for r in out.eval] == ["1200", "1800"]


def test_math_tarball_layout_and_math500_file(tmp_path):
    src = tmp_path / "MATH"
    for split, rows in (("train", MATH_ROWS[:2]), ("test", MATH_ROWS[2:])):
        for i, row in enumerate(rows):
            folder = src / split / row["type"].lower()
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{i}.json").write_text(json.dumps(row))
    out = prepare(DATASETS["math"], src)
    assert sorted(r["answer"] for r in out.train) == ["4", "\\frac{3}{4}"]
    assert [r["answer"] for r in out.eval] == ["\\{-3, 3\\}"]          # nested braces kept
    assert out.train[0]["level"].startswith("Level") and "\\boxed{}" in out.train[0]["prompt"][0]["content"]
    # MATH-500: one test.jsonl whose rows carry their answer; held out: a seeded sample
    rows = [dict(r, answer=f"a{i}", subject=r["type"], unique_id=f"test/x/{i}.json") for i, r in enumerate(MATH_ROWS * 7)]
    m500 = prepare(DATASETS["math"], write_jsonl(tmp_path / "test.jsonl", rows), eval_size=5, seed=3)
    assert len(m500.train) == 16 and len(m500.eval) == 5
    assert {r["answer"] for r in m500.train}.isdisjoint(r["answer"] for r in m500.eval)
    assert prepare(DATASETS["math"], tmp_path / "test.jsonl", eval_size=5, seed=3).eval == m500.eval


def test_dapo_math_parquet_schema_keeps_the_messages_and_drops_repeats(tmp_path):
    message = pa.struct([("content", pa.string()), ("role", pa.string())])
    schema = pa.schema([("data_source", pa.string()), ("prompt", pa.list_(message)), ("ability", pa.string()),
                        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
                        ("extra_info", pa.struct([("index", pa.string())]))])
    text = ("Solve the following math problem step by step. The last line of your response should be of the "
            "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nWhat is {}+1?")
    rows = [{"data_source": "math_dapo", "prompt": [{"content": text.format(n), "role": "user"}], "ability": "MATH",
             "reward_model": {"ground_truth": str(n + 1), "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": f"id-{n}"}} for n in range(40)] * 3
    write_parquet(tmp_path / "data" / "dapo-math-17k.parquet", rows, schema)
    out = prepare(DATASETS["dapo-math-17k"], tmp_path, eval_size=4)
    assert out.dropped_duplicates == 80 and len(out.train) == 36 and len(out.eval) == 4
    for r in out.train + out.eval:   # the messages as published, the ground truth as the answer
        n = int(r["answer"]) - 1
        assert r["prompt"] == [{"role": "user", "content": text.format(n)}] and r["data_source"] == "dapo-math-17k"
    n = int(out.train[0]["answer"]) - 1
    assert math_answer_reward(f"so {n}+1={n + 1}.\nAnswer: {n + 1}", out.train[0]["answer"]) == 1.0


def test_generic_map_reads_any_columns(tmp_path):
    rows = [{"q": f"what is {n}*2?", "gold": str(2 * n)} for n in range(30)]
    rec = generic_record(parse_map(["prompt=q", "answer=gold"]))
    from megarl.data.prepare import Dataset

    out = prepare(Dataset("generic", {"train": ("*.jsonl",), "test": ()}, rec, None),
                  write_jsonl(tmp_path / "mine.jsonl", rows), eval_size=3)
    assert len(out.train) == 27 and out.eval[0]["prompt"][0]["content"].startswith("what is")
    with pytest.raises(DataError, match="--map: give answer=COLUMN"):
        parse_map(["prompt=q"])


def test_prepared_files_are_what_megarl_train_reads(tmp_path):
    """The CLI writes train/eval files that the loaders and a validated config accept, JSONL and parquet."""
    src = tmp_path / "gsm8k"
    write_parquet(src / "main" / "train-00000-of-00001.parquet", GSM8K * 3)
    write_parquet(src / "main" / "test-00000-of-00001.parquet", GSM8K[:2])
    for fmt, loader in (("jsonl", load_jsonl), ("parquet", load_parquet)):
        out = tmp_path / f"out-{fmt}"
        r = megarl("data", "prepare", "gsm8k", "--src", str(src), "--out", str(out), "--format", fmt)
        assert r.returncode == 0, r.stderr
        assert f"data.path={out / f'train.{fmt}'}" in r.stdout
        records = loader(out / f"train.{fmt}")
        assert len(records) == 12 and records[0].answer == "6"
        model = tiny_model(tmp_path)
        cfg = load_config(DEFAULT, tiny_overrides(model, tmp_path / "run", f"data.source={fmt}",
                                                  f"data.path={out / f'train.{fmt}'}",
                                                  f"data.eval_path={out / f'eval.{fmt}'}", "reward.kind=rule"))
        validate_config(cfg, check_paths=True)


def test_prepared_math_trains_one_step(tmp_path):
    from megarl.trainer import Trainer

    rows = [dict(r, answer=r["solution"][r["solution"].rfind("boxed{") + 6:-3]) for r in MATH_ROWS * 4]
    out = tmp_path / "math"
    r = megarl("data", "prepare", "math", "--src", str(write_jsonl(tmp_path / "test.jsonl", rows)), "--out", str(out),
               "--eval-size", "4")
    assert r.returncode == 0, r.stderr
    cfg = load_config(DEFAULT, tiny_overrides(tiny_model(tmp_path), tmp_path / "run", "data.source=jsonl",
                                              f"data.path={out / 'train.jsonl'}", f"data.eval_path={out / 'eval.jsonl'}",
                                              "reward.kind=rule", "trainer.total_steps=1",
                                              "trainer.eval_before_after=false", "checkpoint.export_hf=false"))
    validate_config(cfg, check_paths=True)
    steps = Trainer(cfg).run()["steps"]
    assert len(steps) == 1 and steps[0]["batch/samples"] > 0


def test_bad_input_is_one_line_naming_the_file(tmp_path):
    one_error_line(megarl("data", "prepare", "gsm8k", "--src", str(tmp_path / "nope"), "--out", str(tmp_path / "o")),
                   "data", "nope: no such file or folder")
    bad = write_parquet(tmp_path / "g" / "train-00000-of-00001.parquet", [{"q": "x", "answer": "#### 1"}])
    line = one_error_line(megarl("data", "prepare", "gsm8k", "--src", str(bad.parent), "--out", str(tmp_path / "o")),
                          "data", "train-00000-of-00001.parquet:row 1: no field 'question'")
    assert "fields are ['answer', 'q']" in line
    assert not (tmp_path / "o").exists()       # nothing written before the input was read whole
