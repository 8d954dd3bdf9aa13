"""Validation of ``reward.judge`` (and of what every reward kind shares: retries, failed steps).

Why its own module: the judge has a dozen settings whose mistakes would otherwise show up only at
the first step -- a template without the response, a pattern without a group, a judge the run
cannot reach or start -- and each must be one line naming its field before any process starts.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from megarl.config.schema import RunConfig


def judge_problems(cfg: RunConfig) -> list[str]:
    """One line per wrong field of ``reward.retries``, ``reward.max_failed_steps`` and, for
    ``reward.kind: judge``, ``reward.judge.*`` (files and environment: :func:`judge_path_problems`)."""
    rw = cfg.reward
    problems = []
    if rw.retries < 0:
        problems.append(f"reward.retries: must be >= 0, got {rw.retries}")
    if rw.max_failed_steps < 0:
        problems.append(f"reward.max_failed_steps: must be >= 0 (0 = never stop), got {rw.max_failed_steps}")
    if rw.kind != "judge":
        return problems
    if cfg.agent.enabled:
        problems.append("reward.kind: judge is not used with agent.enabled (the environment gives the reward)")
    j = rw.judge
    if not j.server_url and not j.model_path:
        problems.append("reward.judge.model_path: reward.kind = 'judge' needs a judge -- judge.server_url (a running "
                        "server) or judge.model_path (megarl serves it)")
    if j.server_url and not (j.tokenizer or j.model_path):
        problems.append("reward.judge.tokenizer: a judge given by server_url needs its tokenizer (judge.tokenizer or "
                        "judge.model_path): prompts travel as token ids")
    if j.server_url and not re.match(r"^https?://[^/\s]+", j.server_url):
        problems.append(f"reward.judge.server_url: {j.server_url!r} must look like http://host:port")
    if j.template is not None and "{response}" not in j.template:
        problems.append("reward.judge.template: has no {response} placeholder (the judge would never see the answer)")
    problems += _parser_problems(j)
    for name in ("max_new_tokens", "batch_size", "max_concurrency"):
        if getattr(j, name) < 1:
            problems.append(f"reward.judge.{name}: must be >= 1, got {getattr(j, name)}")
    if j.timeout_s <= 0:
        problems.append(f"reward.judge.timeout_s: must be > 0, got {j.timeout_s}")
    if j.context_length <= j.max_new_tokens:
        problems.append(f"reward.judge.context_length: {j.context_length} leaves no room for a prompt beside "
                        f"max_new_tokens = {j.max_new_tokens}")
    if not j.server_url:
        if cfg.cluster.device == "cuda" and not j.devices:
            problems.append("reward.judge.devices: a judge megarl serves on a GPU run needs its GPU ids (ones the "
                            "run's pools leave free), or give judge.server_url")
        if cfg.cluster.device == "cpu" and j.devices:
            problems.append("reward.judge.devices: a CPU run serves the judge on the CPU; leave devices empty")
    return problems


def _parser_problems(j: Any) -> list[str]:
    if j.parser != "score":
        if not re.match(r"^[\w.]+:\w+$", j.parser):
            return [f"reward.judge.parser: {j.parser!r} must be 'score' or package.module:function"]
        return []
    try:
        groups = re.compile(j.score_pattern).groups
    except re.error as err:
        return [f"reward.judge.score_pattern: not a regular expression ({err})"]
    problems = [] if groups >= 1 else [f"reward.judge.score_pattern: {j.score_pattern!r} has no group for the grade"]
    if len(j.score_range) != 2 or not j.score_range[0] < j.score_range[1]:
        problems.append(f"reward.judge.score_range: must be [lowest, highest] with lowest < highest, got {j.score_range}")
    return problems


def judge_path_problems(cfg: RunConfig) -> list[str]:
    """At launch: the judge's model folder, tokenizer and API key variable exist."""
    if cfg.reward.kind != "judge":
        return []
    j, problems = cfg.reward.judge, []
    for name in ("model_path", "tokenizer"):
        path = getattr(j, name)
        if path and not (Path(path).expanduser() / "config.json").is_file() and not (
                Path(path).expanduser() / "tokenizer_config.json").is_file():
            problems.append(f"reward.judge.{name}: {path!r} is not an HF folder (no config.json)")
    if j.api_key_env and not os.environ.get(j.api_key_env):
        problems.append(f"reward.judge.api_key_env: ${j.api_key_env} is not set; export it with the judge server's "
                        f"API key, or set api_key_env: null")
    return problems
