"""The CLI's one error path (megarl/errors.py, megarl/cli.py), run as a user runs it: ``python -m
megarl ...`` in a subprocess. An error the user caused -- a bad data row, a config field, a missing
recipe, a key a server refuses, a server that is not there, a model folder without weights on
every Ray rank -- is one line naming the field, file:line or server, and exit status 2, printed
once however many ranks hit it; an internal error keeps its traceback; ``--debug`` shows tracebacks
for all. Plus the classifier itself on the real wrappers (Ray's task error, a chained SyncError)."""
from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config
from megarl.config.validate import api_key_env_problem
from megarl.data.sources import DataError
from megarl.errors import UserError, find_user_error, user_error_line
from megarl.wire.addresses import free_port
from megarl.rollout.client import ServerDown, Unauthorized
from tests.helpers.servers import ServerProcess
from megarl.sync.session import SyncError
from tests.helpers.runs import DEFAULT, ROOT, tiny_model, tiny_overrides

KEY = "cli-errors-key-5d1e"


def megarl(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m megarl ARGS`` with this checkout, no API key but the one in ``env``."""
    e = {k: v for k, v in os.environ.items() if k not in ("MEGARL_API_KEY", "MY_KEY")}
    e.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "megarl", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env=e)


def one_error_line(r: subprocess.CompletedProcess, command: str, *must: str) -> str:
    """The run ended with exit 2 and exactly one error line (``megarl COMMAND: ...``, the last line
    of stderr, printed once in all of the output), containing ``must``; no traceback anywhere."""
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    out = r.stdout + r.stderr
    assert "Traceback" not in out and "RayTaskError" not in out, r.stderr[-3000:]
    line = r.stderr.rstrip("\n").splitlines()[-1]
    assert line.startswith(f"megarl {command}: "), r.stderr[-3000:]
    assert out.count(line) == 1 and len([x for x in out.splitlines() if x.startswith(f"megarl {command}:")]) == 1
    for m in must:
        assert m in line, (m, line)
    return line


# ---------------------------------------------------------------------------- classifier
def test_errors_module_imports_nothing_of_megarl():
    tree = ast.parse((ROOT / "megarl" / "errors.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] in ("megarl", "torch", "ray")], names


def test_classifier_unwraps_ray_and_chained_errors():
    from ray.exceptions import RayTaskError
    import torch

    data = DataError("bad.jsonl:2: field 'prompt' must be a string")
    wrapped = RayTaskError("execute", "Traceback (most recent call last):\n  ...\nDataError: ...", data)
    for exc in (wrapped, wrapped.as_instanceof_cause()):   # what ray.get raises: also a DataError subclass
        assert user_error_line(exc) == "bad.jsonl:2: field 'prompt' must be a string"
    refused = Unauthorized("http://10.0.0.7:30000/begin_weight_update", 401, {"error": "Unauthorized"}, True)
    try:
        raise SyncError("begin_weight_update refused: http://10.0.0.7:30000: Unauthorized") from refused
    except SyncError as e:
        assert find_user_error(e) is refused
        assert user_error_line(e).startswith("http://10.0.0.7:30000/begin_weight_update: HTTP 401 unauthorized")
    assert user_error_line(ConfigError(["a.b: bad"])) == "invalid config: a.b: bad"
    assert user_error_line(ConfigError(["a.b: bad", "c.d: worse"])) == "invalid config:\n  a.b: bad\n  c.d: worse"
    assert user_error_line(FileNotFoundError(2, "No such file or directory", "/x/y.yaml")) == \
        "/x/y.yaml: No such file or directory"
    assert user_error_line(ServerDown("http://h:1", "unreachable")) == "http://h:1: unreachable"
    oom = user_error_line(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore"))
    assert oom.startswith("out of memory: CUDA out of memory. Tried to allocate 2.00 GiB") and "megarl plan" in oom
    assert issubclass(ConfigError, (UserError, ValueError)) and issubclass(DataError, (UserError, ValueError))
    # internal errors stay internal: no marker, or a user error only in the implicit context
    assert user_error_line(RuntimeError("shapes do not match")) is None
    try:
        try:
            raise data
        except DataError:
            raise KeyError("a bug while handling it")
    except KeyError as e:
        assert user_error_line(e) is None


# ---------------------------------------------------------------------------- CLI, no run
def test_config_errors_missing_recipe_and_planner_are_one_line():
    line = one_error_line(megarl("config", str(DEFAULT), "checkpoint.keep_last=-1"), "config")
    assert line == "megarl config: invalid config: checkpoint.keep_last: must be >= 0 (0 keeps all), got -1"
    # several wrong fields: one line each, under one header
    r = megarl("config", str(DEFAULT), "rollout.request_retries=-1", "checkpoint.keep_last=-1")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.rstrip("\n").splitlines()[-3:] == [
        "megarl config: invalid config:", "  rollout.request_retries: must be >= 0, got -1",
        "  checkpoint.keep_last: must be >= 0 (0 keeps all), got -1"], r.stderr
    one_error_line(megarl("train", "recipes/no-such-recipe.yaml"), "train", "recipe 'recipes/no-such-recipe.yaml'",
                   "no such file")
    one_error_line(megarl("train", str(DEFAULT), "actor.gpus=two"), "train", "actor.gpus:")
    one_error_line(megarl("plan", str(DEFAULT), "cluster.gpu_type=Z100"), "plan", "cluster.gpu_type:", "'Z100'")


def test_internal_errors_keep_their_traceback():
    """A command failing inside (here ``json.loads`` handed the argv list: a TypeError) is not the
    user's doing: traceback, Python's exit status 1."""
    code = ("import sys, megarl.cli as c; c.DELEGATED['plan'] = ('json:loads', ''); "
            "sys.exit(c.main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "plan", "x"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 1 and "Traceback" in r.stderr and r.stderr.rstrip().splitlines()[-1].startswith(
        "TypeError: the JSON object must be"), r.stderr[-2000:]


def test_named_api_key_variable_that_is_unset_is_a_config_error(tmp_path, monkeypatch):
    r = megarl("train", str(DEFAULT), "rollout.api_key_env=MY_KEY", f"rollout.server_urls=[http://127.0.0.1:{free_port()}]",
               f"output_dir={tmp_path / 'out'}")
    one_error_line(r, "train", "rollout.api_key_env: $MY_KEY is not set")
    assert not (tmp_path / "out").exists()                       # stopped before anything started
    # the default variable unset keeps its meaning (no key for server_urls, a fresh one for the
    # servers megarl starts); a named variable that is set is used
    monkeypatch.delenv("MEGARL_API_KEY", raising=False)
    monkeypatch.delenv("MY_KEY", raising=False)
    named = ["rollout.api_key_env=MY_KEY"]
    for urls in (["rollout.server_urls=[http://h:1]"], []):
        assert api_key_env_problem(load_config(DEFAULT, urls)) is None
        assert "rollout.api_key_env: $MY_KEY is not set" in api_key_env_problem(load_config(DEFAULT, urls + named))
    monkeypatch.setenv("MY_KEY", "k1")
    assert api_key_env_problem(load_config(DEFAULT, named)) is None


def test_bad_data_row_is_one_line_and_debug_shows_the_traceback(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n" + json.dumps({"prompt": 5, "answer": "3"}) + "\n")
    args = ["train", str(DEFAULT), "data.source=jsonl", f"data.path={bad}", f"output_dir={tmp_path / 'out'}",
            "cluster.backend=local"]
    one_error_line(megarl(*args), "train", f"{bad}:2: field 'prompt' must be a string")
    r = megarl("--debug", *args)
    assert r.returncode == 2 and "Traceback" in r.stderr and "megarl.data.sources.DataError" in r.stderr
    assert r.stderr.rstrip().splitlines()[-1].startswith(f"megarl train: {bad}:2:")


# ---------------------------------------------------------------------------- CLI, runs against servers
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny model, the same folder without its weights, and an embedded server holding KEY."""
    root = tmp_path_factory.mktemp("cli_errors")
    model = tiny_model(root)
    bare = root / "no_weights"
    bare.mkdir()
    for f in model.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, bare / f.name)
    with ServerProcess(str(model), env={"MEGARL_API_KEY": KEY}) as server:
        yield {"model": model, "bare": bare, "url": server.url, "root": root}


def test_refused_api_key_names_the_server(served):
    r = megarl("train", str(DEFAULT), *tiny_overrides(served["model"], served["root"] / "refused"),
               f"rollout.server_urls=[{served['url']}]", env={"MEGARL_API_KEY": "not-the-servers-key"})
    one_error_line(r, "train", served["url"], "HTTP 401 unauthorized", "the API key sent was refused")


def test_unreachable_server_names_it(served):
    url = f"http://127.0.0.1:{free_port()}"
    r = megarl("train", str(DEFAULT), *tiny_overrides(served["model"], served["root"] / "unreachable"),
               f"rollout.server_urls=[{url}]", env={"MEGARL_API_KEY": KEY})
    one_error_line(r, "train", url, "does not answer /health", "rollout.server_urls")


def test_error_on_every_ray_rank_is_printed_once(served):
    """Both actor ranks (Ray actors) fail to load the weights; the driver prints one line."""
    r = megarl("train", str(DEFAULT), *tiny_overrides(served["bare"], served["root"] / "ray"),
               f"rollout.server_urls=[{served['url']}]", "cluster.backend=ray", "actor.gpus=2",
               env={"MEGARL_API_KEY": KEY})
    line = one_error_line(r, "train", f"no *.safetensors in {served['bare']}")
    assert (r.stdout + r.stderr).count("no *.safetensors") == 1, line
