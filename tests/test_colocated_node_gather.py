"""The colocated push's one-gather-per-node (megarl/sync/colocated.py ``iter_hf_weights_by_node``)
across two network-namespace nodes: it yields exactly the everywhere gather's tensors (plain and
in the served block-FP8 format) on every rank, while each tensor crosses to the other node once
(half of a node's intake on each of its ranks) instead of once per rank.

Needs root (network namespaces); skipped otherwise, which CI counts as a failure.
"""
from __future__ import annotations

import json
import sys

import pytest

from megarl.sync.colocated import nodes_of
from tests.helpers.servers import make_tiny_hf_model
from tests.netns_cluster import NetnsCluster, netns_available

_why = netns_available()
PORT = 29533       # inside fresh namespaces: nothing else binds it


@pytest.mark.skipif(_why is not None, reason=_why or "")
def test_node_gather_equals_everywhere_and_crosses_each_tensor_once(tmp_path):
    make_tiny_hf_model(str(tmp_path / "m"), "qwen2", num_hidden_layers=4, tie_word_embeddings=False)
    with NetnsCluster(2) as box:
        master = box.address(0)
        procs = []
        for rank in range(4):           # TP2 x PP2: stage 0 = ranks 0, 1 on node 0; stage 1 on node 1
            env = {"RANK": str(rank), "WORLD_SIZE": "4", "MASTER_ADDR": master, "MASTER_PORT": str(PORT),
                   "LOCAL_RANK": str(rank % 2)}
            procs.append(box.popen(rank // 2, [sys.executable, "-m", "tests.helpers.node_gather_rank",
                                               str(tmp_path / "m"), "2", "2"], env=env, stdout=-1, stderr=-1,
                                   text=True))
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    assert all(o["nodes"] == [[0, 1], [2, 3]] and o["fits"] for o in outs)
    assert all(o["plain_equal"] and o["fp8_equal"] for o in outs), outs
    assert len({o["tensors"] for o in outs}) == 1 and outs[0]["fp8_model_bytes"] < outs[0]["model_bytes"]
    # every rank cuts the same buckets: the same order everywhere (each server's IPC payloads line up)
    assert all(o["fp8_order"] == outs[0]["fp8_order"] for o in outs)
    for form, total in (("plain", outs[0]["model_bytes"]), ("fp8", outs[0]["fp8_model_bytes"])):
        got = [o[form]["network_in"] for o in outs]
        # each stage's bytes reach the other node once (the everywhere gather: once per rank, 2x)
        assert sum(got) == total, (form, got, total)
        assert all(g > 0 for g in got), (form, got)          # both ranks of a node take turns
        assert sum(o[form]["network_out"] for o in outs) == total


def test_node_layout_names_a_group_that_spans_nodes():
    fits = nodes_of([("a", [0, 1], [0]), ("a", [0, 1], [1]), ("b", [2, 3], [2]), ("b", [2, 3], [3])])
    assert fits.nodes == [[0, 1], [2, 3]] and fits.fits and fits.node_of == {0: 0, 1: 0, 2: 1, 3: 1}
    split = nodes_of([("a", [0, 1], [0]), ("b", [0, 1], [1]), ("a", [2, 3], [2]), ("b", [2, 3], [3])])
    assert split.nodes == [[0, 2], [1, 3]] and not split.fits
    assert split.why == "rank 0's tensor-parallel group [0, 1] spans nodes"
