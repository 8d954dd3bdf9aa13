"""Weight-update sessions of the embedded server vs SGLang 0.5.23's scheduler weight updater.

The messages are checked against SGLang's own source (`scheduler_components/weight_updater.py`,
read with `ast`: the package does not import without its GPU stack); the behaviour against a
real server process over raw HTTP: 400 outside a session, the distributed refusal answered
BEFORE the server joins the broadcast, double begin / end without begin, disk without a session.
"""
import ast
import importlib.util
import os
import shutil
import time

import pytest

from megarl.wire.addresses import free_port
from megarl.engine import session
from tests.helpers.servers import ServerProcess, make_tiny_hf_model
from tests.helpers.weights_http import DistributedSender, call, flattened_payload, generate, ok
from tests.test_server_tp import assert_serves, checkpoint_tensors


def _sglang_file(rel):
    spec = importlib.util.find_spec("sglang")   # locates the wheel without importing it
    assert spec is not None, "sglang 0.5.23 (installed --no-deps) is the reference: pip install --no-deps sglang==0.5.23"
    return os.path.join(list(spec.submodule_search_locations)[0], rel)


def _string_constants(path):
    return {n.value for n in ast.walk(ast.parse(open(path).read())) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_messages_are_sglangs():
    consts = _string_constants(_sglang_file("srt/managers/scheduler_components/weight_updater.py"))
    for op in ("update_weights_from_distributed", "update_weights_from_tensor"):
        assert session.OUTSIDE_SESSION.format(op=op) in consts
    assert session.ALREADY_OPEN in consts and session.NOT_OPEN in consts
    # the selector values are SGLang's Literal
    io_struct = open(_sglang_file("srt/managers/io_struct.py")).read()
    assert 'selector: Literal["target", "draft", "all"] = "all"' in io_struct
    assert session.SELECTORS == ("target", "draft", "all")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tmp_path_factory.mktemp("sessions")
    a = make_tiny_hf_model(str(d / "a"), "qwen2", seed=0, std=0.3)
    b = make_tiny_hf_model(str(d / "b"), "qwen2", seed=1, std=0.3)
    s = ServerProcess(str(d / "a"), extra=["--weights-dir", str(d / "w")])
    try:
        yield s.wait_ready(), d, a, b
    finally:
        s.stop()


def test_session_rules(srv):
    s, d, a, b = srv
    named = checkpoint_tensors(str(d / "b"))
    # tensor update outside a session: SGLang's 400
    status, body = call(s.url, "/update_weights_from_tensor",
                        {"serialized_named_tensors": [flattened_payload(named)], "load_format": "flattened_bucket"})
    assert (status, body) == (400, {"success": False, "message": session.OUTSIDE_SESSION.format(
        op="update_weights_from_tensor")})
    # end without begin, begin twice, end twice
    assert call(s.url, "/end_weight_update", {}) == (400, {"success": False, "message": session.NOT_OPEN})
    assert call(s.url, "/begin_weight_update", {}) == (200, {"success": True, "message": "Success"})
    assert call(s.url, "/begin_weight_update", {}) == (400, {"success": False, "message": session.ALREADY_OPEN})
    assert call(s.url, "/end_weight_update", {}) == (200, {"success": True, "message": "Success"})
    assert call(s.url, "/end_weight_update", {}) == (400, {"success": False, "message": session.NOT_OPEN})
    status, body = call(s.url, "/begin_weight_update", {"selector": "bogus"})
    assert status == 400 and "invalid selector 'bogus'" in body["message"]
    assert_serves(s.url, a)                     # nothing above touched the weights


def test_distributed_refusal_comes_before_the_broadcast(srv):
    s, d, a, b = srv
    named = checkpoint_tensors(str(d / "b"))
    snd = DistributedSender([s.url], [1], free_port(), group="g_sess")
    assert snd.init_answers[0][0] == 200
    t0 = time.time()
    fut, = snd.post(named)                      # outside a session; this side never broadcasts
    status, body = fut.result(300)              # a hang guard; the answer (400, not joined) is what proves it
    assert time.time() - t0 < 60
    assert (status, body) == (400, {"success": False, "message": session.OUTSIDE_SESSION.format(
        op="update_weights_from_distributed")})
    # an unknown group is refused before joining as well (SGLang's assertion in receive)
    ok(s.url, "/begin_weight_update")
    status, body = call(s.url, "/update_weights_from_distributed",
                        {"names": ["x"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "nope"})
    assert status == 400 and body["message"].startswith("Failed to receive weights: Group nope not in ['g_sess']")
    # the group is intact: the server never entered a broadcast above, so this one lines up
    (status, body), = snd.push(named, weight_version="b")
    assert status == 200, body
    ok(s.url, "/end_weight_update")
    snd.close()
    assert_serves(s.url, b)
    info = call(s.url, "/get_model_info")[1]
    assert info["megarl_weight_sessions"] >= 1


def test_draft_selector_loads_nothing_and_disk_needs_no_session(srv):
    s, d, a, b = srv
    named = checkpoint_tensors(str(d / "a"))
    before = generate(s.url, [5, 6, 7])
    ok(s.url, "/begin_weight_update", {"selector": "draft"})
    # no draft model: SGLang selects no runner, answers success and loads nothing
    ok(s.url, "/update_weights_from_tensor", {"serialized_named_tensors": [flattened_payload(named)],
                                              "load_format": "flattened_bucket", "selector": "draft"})
    ok(s.url, "/end_weight_update")
    assert generate(s.url, [5, 6, 7])["output_ids"] == before["output_ids"]
    # disk: no session needed (SGLang's update_weights_from_disk has no session check)
    shutil.copytree(d / "a", d / "w" / "a")
    body = ok(s.url, "/update_weights_from_disk", {"model_path": str(d / "w" / "a")})
    assert body["success"] and body["num_paused_requests"] == 0
    assert_serves(s.url, a)


def test_gate_unit():
    g = session.SessionGate()
    with pytest.raises(session.SessionError, match="update_weights_from_tensor must run between"):
        g.require("update_weights_from_tensor")
    g.begin("target")
    assert g.require("x").selector == "target" and not g.session.loaded_weights
    g.loaded()
    assert g.session.loaded_weights
    with pytest.raises(session.SessionError):
        g.begin()
    g.end()
    assert g.session is None and g.opened == 1
    assert session.applies_to_target("all") and session.applies_to_target("target")
    assert not session.applies_to_target("draft")
