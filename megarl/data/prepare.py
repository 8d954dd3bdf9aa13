"""``megarl data prepare NAME --src PATH --out DIR``: public math datasets, as their publishers lay
them out on disk, into megarl's chat JSONL (or parquet) with answers and a held-out split.

Nothing is fetched: the user downloads a dataset (``huggingface-cli download``, a git clone, a
tarball) and points ``--src`` at the file or folder. Each dataset reads its real layouts:

* ``gsm8k`` -- openai/gsm8k: ``main/train-*.parquet`` + ``main/test-*.parquet`` (Hugging Face), or
  ``train.jsonl`` + ``test.jsonl`` (the original repository); fields ``question``, ``answer`` with
  the final answer after ``####``.
* ``math`` -- Hendrycks MATH: ``train/<subject>/<id>.json`` + ``test/...`` (the original tarball),
  ``<subject>/train-*.parquet`` + ``test-*.parquet`` (EleutherAI/hendrycks_math), or one
  ``test.jsonl`` of MATH-500; fields ``problem`` and ``answer``, or ``solution`` whose last
  ``\\boxed{}`` is the answer.
* ``dapo-math-17k`` -- BytedTsinghua-SIA/DAPO-Math-17k's parquet: ``prompt`` (chat messages, kept as
  they are) and ``reward_model.ground_truth``; its rows repeat (each problem many times), so
  identical prompts are kept once.
* ``generic`` -- any JSONL or parquet with ``--map prompt=COL answer=COL``.

Prompts get the instruction verl's preprocessing gives each dataset (so the rule reward finds the
answer: ``####`` for GSM8K, ``\\boxed{}`` for MATH). The held-out split is the dataset's own test
split where it has one, else a seeded ``--eval-size`` sample. A missing file or a wrong column is
one line naming the file (``DataError``), before anything is written.
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from megarl.data.answers import gsm8k_final, last_boxed
from megarl.data.sources import DataError

GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
DEFAULT_EVAL_FRACTION, DEFAULT_EVAL_CAP = 0.05, 500


@dataclass
class Row:
    """One source row and where it came from (for error messages)."""

    fields: dict[str, Any]
    where: str


# ------------------------------------------------------------------------------------ reading

def read_table(path: Path) -> list[Row]:
    """Rows of one JSONL, JSON (one object or a list) or parquet file."""
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return [Row(r, f"{path}:row {i + 1}") for i, r in enumerate(pq.read_table(path).to_pylist())]
    rows = []
    if path.suffix == ".json":
        data = _json(path.read_text(), str(path))
        items = data if isinstance(data, list) else [data]
        return [Row(_object(r, f"{path}[{i}]"), f"{path}[{i}]") for i, r in enumerate(items)]
    with path.open() as handle:
        for lineno, line in enumerate(handle, 1):
            if line.strip():
                where = f"{path}:{lineno}"
                rows.append(Row(_object(_json(line, where), where), where))
    return rows


def _json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: invalid JSON: {err.msg}") from None


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _tables(files: list[Path]) -> list[Row]:
    return [row for f in sorted(files) for row in read_table(f)]


def split_files(src: Path, patterns: dict[str, tuple[str, ...]]) -> dict[str, list[Path]]:
    """``src`` itself as the only train file, or the files of a folder matching each split's glob
    patterns (the first pattern that matches anything wins)."""
    if src.is_file():
        return {"train": [src], "test": []}
    if not src.is_dir():
        raise DataError(f"{src}: no such file or folder")
    found: dict[str, list[Path]] = {}
    for split, globs in patterns.items():
        found[split] = next((sorted(src.glob(g)) for g in globs if any(src.glob(g))), [])
    if not found.get("train"):
        wanted = ", ".join(patterns["train"])
        raise DataError(f"{src}: no train file ({wanted}); point --src at the dataset's file or folder")
    return found


# ------------------------------------------------------------------------------------ datasets

def _need(row: Row, *names: str) -> list[Any]:
    missing = [n for n in names if n not in row.fields]
    if missing:
        raise DataError(f"{row.where}: no field {missing[0]!r}; fields are {sorted(row.fields)}")
    return [row.fields[n] for n in names]


def _user(text: str, instruction: Optional[str]) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{text} {instruction}" if instruction else text}]


def gsm8k_record(row: Row, instruction: Optional[str]) -> dict[str, Any]:
    question, answer = _need(row, "question", "answer")
    final = gsm8k_final(str(answer))
    if final is None:
        raise DataError(f"{row.where}: field 'answer' has no final answer after '####'")
    return {"prompt": _user(str(question), instruction), "answer": final, "data_source": "gsm8k"}


def math_record(row: Row, instruction: Optional[str]) -> dict[str, Any]:
    (problem,) = _need(row, "problem")
    answer = row.fields.get("answer")
    if answer is None:
        if "solution" not in row.fields:
            raise DataError(f"{row.where}: no field 'answer' or 'solution'; fields are {sorted(row.fields)}")
        answer = last_boxed(str(row.fields["solution"]))
        if answer is None:
            raise DataError(f"{row.where}: field 'solution' has no \\boxed{{}} answer")
    extra = {k: row.fields[k] for k in ("level", "type", "subject", "unique_id") if k in row.fields}
    return {"prompt": _user(str(problem), instruction), "answer": str(answer).strip(), "data_source": "math", **extra}


def dapo_record(row: Row, instruction: Optional[str]) -> dict[str, Any]:
    prompt, reward_model = _need(row, "prompt", "reward_model")
    if not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) and {"role", "content"} <= set(m)
                                                      for m in prompt)):
        raise DataError(f"{row.where}: field 'prompt' must be a list of {{role, content}} messages")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise DataError(f"{row.where}: field 'reward_model' has no 'ground_truth'")
    messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    if instruction:
        messages[-1]["content"] = f"{messages[-1]['content']} {instruction}"
    return {"prompt": messages, "answer": str(reward_model["ground_truth"]), "data_source": "dapo-math-17k"}


def generic_record(mapping: dict[str, str]) -> Callable[[Row, Optional[str]], dict[str, Any]]:
    def record(row: Row, instruction: Optional[str]) -> dict[str, Any]:
        prompt, answer = _need(row, mapping["prompt"], mapping["answer"])
        if isinstance(prompt, str):
            prompt = _user(prompt, instruction)
        elif not (isinstance(prompt, list) and all(isinstance(m, dict) and {"role", "content"} <= set(m)
                                                   for m in prompt)):
            raise DataError(f"{row.where}: field {mapping['prompt']!r} must be a string or chat messages")
        return {"prompt": prompt, "answer": str(answer)}
    return record


@dataclass(frozen=True)
class Dataset:
    name: str
    splits: dict[str, tuple[str, ...]]            # split -> glob patterns under --src
    record: Callable[[Row, Optional[str]], dict[str, Any]]
    instruction: Optional[str]
    dedup: bool = False


DATASETS = {
    "gsm8k": Dataset("gsm8k", {"train": ("main/train-*.parquet", "train-*.parquet", "**/train.jsonl"),
                               "test": ("main/test-*.parquet", "test-*.parquet", "**/test.jsonl")},
                     gsm8k_record, GSM8K_INSTRUCTION),
    "math": Dataset("math", {"train": ("train/*/*.json", "*/train-*.parquet", "train-*.parquet"),
                             "test": ("test/*/*.json", "*/test-*.parquet", "test-*.parquet")},
                    math_record, MATH_INSTRUCTION),
    "dapo-math-17k": Dataset("dapo-math-17k", {"train": ("data/*.parquet", "*.parquet"), "test": ()},
                             dapo_record, None, dedup=True),
}


# ------------------------------------------------------------------------------------ preparing

@dataclass
class Prepared:
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    dropped_duplicates: int = 0


def prepare(dataset: Dataset, src: Path, *, eval_size: Optional[int] = None, seed: int = 0,
            instruction: Optional[str] = None) -> Prepared:
    """Every row converted (the first bad row stops it, named), duplicates dropped where the
    dataset repeats itself, and the held-out split: the dataset's test split (``eval_size`` rows of
    it, seeded, when given), else a seeded sample of ``eval_size`` train rows (default 5%, at most
    500) taken out of train."""
    files = split_files(src, dataset.splits)
    text = dataset.instruction if instruction is None else (instruction or None)
    train = [dataset.record(r, text) for r in _tables(files["train"])]
    test = [dataset.record(r, text) for r in _tables(files.get("test", []))]
    dropped = 0
    if dataset.dedup:
        train, dropped = _unique(train)
    rng = random.Random(seed)
    if test:
        if eval_size is not None and eval_size < len(test):
            test = rng.sample(test, eval_size)
        return Prepared(train, test, dropped)
    n = eval_size if eval_size is not None else min(DEFAULT_EVAL_CAP, int(len(train) * DEFAULT_EVAL_FRACTION))
    if n >= len(train):
        raise DataError(f"{src}: {len(train)} rows cannot give {n} held-out rows and a train split")
    held = set(rng.sample(range(len(train)), n))
    return Prepared([r for i, r in enumerate(train) if i not in held], [r for i, r in enumerate(train) if i in held],
                    dropped)


def _unique(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    seen: set[str] = set()
    out = []
    for r in records:
        key = json.dumps([r["prompt"], r["answer"]], sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out, len(records) - len(out)


def write(records: list[dict[str, Any]], path: Path) -> None:
    """JSONL or parquet by suffix, written to a temporary name and renamed (never half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), tmp)
    else:
        with tmp.open("w") as handle:
            for r in records:
                handle.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(path)


def parse_map(items: list[str]) -> dict[str, str]:
    mapping = {}
    for item in items:
        key, sep, column = item.partition("=")
        if not sep or key not in ("prompt", "answer") or not column:
            raise DataError(f"--map: {item!r} must be prompt=COLUMN or answer=COLUMN")
        mapping[key] = column
    missing = {"prompt", "answer"} - set(mapping)
    if missing:
        raise DataError(f"--map: give {' and '.join(sorted(missing))}=COLUMN too")
    return mapping


def data_main(argv: list[str]) -> int:
    """``megarl data prepare NAME --src PATH --out DIR`` (``megarl data list``: the datasets)."""
    parser = argparse.ArgumentParser(prog="megarl data", description="prepare public datasets for megarl train")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="the datasets `prepare` knows")
    p = sub.add_parser("prepare", help="convert a downloaded dataset into megarl's chat JSONL / parquet")
    p.add_argument("name", choices=[*DATASETS, "generic"])
    p.add_argument("--src", required=True, help="the dataset's file or folder, as downloaded")
    p.add_argument("--out", required=True, help="folder for train.jsonl and eval.jsonl (or .parquet)")
    p.add_argument("--map", nargs="+", default=[], metavar="KEY=COLUMN", help="generic: prompt=COL answer=COL")
    p.add_argument("--eval-size", type=int, default=None, help="held-out rows (default: the test split, else 5%%, "
                                                                "at most 500)")
    p.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    p.add_argument("--instruction", default=None, help="text appended to each prompt ('' = none; default: the "
                                                       "dataset's own)")
    p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.action == "list":
        for name, ds in DATASETS.items():
            print(f"{name:<15} splits: " + "; ".join(f"{s}: {', '.join(g) or '-'}" for s, g in ds.splits.items()))
        print(f"{'generic':<15} any .jsonl / .parquet with --map prompt=COLUMN answer=COLUMN")
        return 0
    if args.name == "generic":
        dataset = Dataset("generic", {"train": ("*.jsonl", "*.parquet"), "test": ()}, generic_record(parse_map(args.map)),
                          None)
    elif args.map:
        raise DataError(f"--map: only for generic; {args.name} has its own columns")
    else:
        dataset = DATASETS[args.name]
    if args.eval_size is not None and args.eval_size < 1:
        raise DataError(f"--eval-size: must be >= 1, got {args.eval_size}")
    out = Path(args.out)
    result = prepare(dataset, Path(args.src), eval_size=args.eval_size, seed=args.seed, instruction=args.instruction)
    out.mkdir(parents=True, exist_ok=True)
    paths = {split: out / f"{split}.{args.format}" for split in ("train", "eval")}
    write(result.train, paths["train"])
    write(result.eval, paths["eval"])
    dup = f", {result.dropped_duplicates} repeated rows dropped" if result.dropped_duplicates else ""
    print(f"megarl data: {args.name}: {len(result.train)} train, {len(result.eval)} held-out rows{dup} -> {out}")
    print(f"  train with: data.source={args.format} data.path={paths['train']} data.eval_path={paths['eval']} "
          f"reward.kind=rule")
    return 0
