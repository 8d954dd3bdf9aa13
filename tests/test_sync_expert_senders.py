"""Expert senders (megarl/sync/stage.py, ``expert_senders=True``): every expert-parallel rank's
ETP0/EDP0 rank streams its own experts, the stage sender the dense weights and EP rank 0's experts;
together they stream exactly what one sender per stage streams, every tensor once, with no expert
transfer. A real push of that shape (two senders, two update groups at once) into an embedded
server, TP1 and TP2, leaves it computing the trainer's logprobs."""
from __future__ import annotations

import pytest

from tests.helpers.servers import ServerProcess, make_tiny_hf_model
from tests.test_sync_megatron import _trainer
from tests.test_sync_stage import LAYOUTS, _all_layouts


@pytest.fixture(scope="module")
def streams(tmp_path_factory):
    from megarl.parallel import spawn

    d = str(tmp_path_factory.mktemp("experts") / "moe")
    make_tiny_hf_model(d, "qwen3_moe", std=0.1, vocab_size=160, tie_word_embeddings=False)
    return spawn(_all_layouts, 4, d, True, timeout_s=600)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_senders_stream_every_tensor_once_without_transfers(streams, layout):
    tp, pp, ep, etp = LAYOUTS[layout]
    res = [r[layout] for r in streams]
    union = res[0]["union"]
    senders = [r for r in res if r["sender"]]
    assert len(senders) == pp * ep, "one sender per stage and expert-parallel rank"
    assert len({r["group"] for r in senders}) == len(senders), "each sender has its own update group"
    for r in res:
        if not r["sender"]:
            assert r["streamed"] == [], f"rank {r['rank']} is no sender but yielded tensors"
    names = [n for r in senders for n, _ in r["streamed"]]
    assert len(names) == len(set(names)), "a tensor was streamed twice"
    assert dict(n_d for r in senders for n_d in r["streamed"]) == union
    local = 4 // ep                                   # the tiny MoE has 4 experts
    for r in senders:
        experts = {int(n.split(".")[5]) for n, _ in r["streamed"] if ".experts." in n}
        assert experts == set(range(r["ep_rank"] * local, (r["ep_rank"] + 1) * local)), (r["rank"], experts)
        if not r["stage_sender"]:
            assert all(".experts." in n for n, _ in r["streamed"]), "an expert sender sends experts only"


@pytest.mark.parametrize("server_tp", [1, 2])
def test_two_expert_senders_push_into_a_server(tmp_path, server_tp):
    from megarl.parallel import spawn

    d = str(tmp_path / "moe")
    make_tiny_hf_model(d, "qwen3_moe", std=0.1, vocab_size=160)
    with ServerProcess(d, extra=["--tp-size", str(server_tp)]) as s:
        res = spawn(_trainer, 2, d, s.url, 1, 2, True, server_tp, timeout_s=300)
    assert [r["sender"] for r in res] == [True, True]
    assert sorted(r["group"] for r in res) == ["megarl_weights_pp0", "megarl_weights_pp0_ep1"]
    assert all(r["stats"]["bytes"] > 0 for r in res)
    assert res[0]["before"] > 1e-2, "the trainer's weights should differ from the server's before the push"
    assert res[0]["after"] < 1e-4, res
