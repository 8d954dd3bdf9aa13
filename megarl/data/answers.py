"""Reference answers as math datasets write them: the last ``\\boxed{...}`` of a worked solution,
the number after GSM8K's ``####``. Shared by dataset preparation (``data/prepare.py``) and the
rule rewards (``rewards/rules.py``), so a prepared answer is the string the scorer extracts."""
from __future__ import annotations


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces kept), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed{") - 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1: j]
    return None


def gsm8k_final(answer: str) -> str | None:
    """GSM8K's final answer: the text after ``####``, thousands separators dropped (``1,000``)."""
    if "####" not in answer:
        return None
    final = answer.rsplit("####", 1)[1].strip()
    return final.replace(",", "") or None
