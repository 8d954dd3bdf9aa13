"""megarl's /generate request with images (`SGLangClient.generate_with_images`) against SGLang
0.5.23's own code, run in the SGLang CPU environment (tests/helpers/sglang_vl.py says exactly which
parts are SGLang's): the JSON bodies the client sends over HTTP pass SGLang's schema gate, parse
into its `GenerateReqInput`, normalize as its tokenizer manager does, and carry our token ids (one
placeholder per image on the wire) and our images byte for byte; SGLang's Qwen2.5-VL multimodal
processor then ends with exactly the ids transformers' processor gave us (placeholders expanded to
the same counts, even text ids that are not the tokenizer's own encoding kept verbatim). The same
ids sent expanded are decoded and tokenized again by SGLang (checked: they change), which is why
the client collapses them.

The prompt's ids and pixels come from megarl's `encode_with_images` (transformers' processor) on a
tiny offline Qwen2.5-VL folder: SmolLM2's tokenizer with Qwen's vision tokens, a one-layer
Qwen2.5-VL config, and transformers' Qwen2-VL image processor with a small pixel budget.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from PIL import Image

from megarl.data.images import ImageRef, encode_with_images, vision_processor
from megarl.rollout.client import BadImage, SGLangClient, collapse_image_runs, sampling_params
from tests.helpers.http import serve
from tests.sglang_cpu.server import ROOT, harness_env, sglang_cpu_python

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def _image(colour: tuple[int, int, int], size: tuple[int, int], fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A Qwen2.5-VL folder SGLang's ModelConfig reads as multimodal (config.json with the vision
    token ids of the tokenizer) and transformers' processor reads offline."""
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2VLImageProcessor

    from megarl.checkpoint.smollm2 import smollm2_hf_dir

    d = tmp_path_factory.mktemp("vl")
    tok = AutoTokenizer.from_pretrained(str(smollm2_hf_dir()))
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for p in m['content'] %}"
                         "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
                         "{% else %}{{ p['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(d)
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tok.convert_tokens_to_ids(VISION_TOKENS)))
    Qwen2_5_VLConfig(text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
                     vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                        spatial_merge_size=2, patch_size=14, temporal_patch_size=2),
                     architectures=["Qwen2_5_VLForConditionalGeneration"], **ids).save_pretrained(d)
    Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16).save_pretrained(d)
    return d


async def _capture(calls) -> tuple[list[dict[str, Any]], list[Any]]:
    """Run ``calls(client)`` against a loopback server answering SGLang-shaped outputs (n per
    request); returns (the JSON bodies the client sent to /generate, what the calls returned)."""
    bodies: list[dict[str, Any]] = []

    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        bodies.append(body)
        n = body["sampling_params"].get("n", 1)
        out = {"output_ids": [7, 8], "meta_info": {"id": "x", "finish_reason": {"type": "stop", "matched": 8},
                                                   "prompt_tokens": len(body["input_ids"]),
                                                   "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]]}}
        return web.json_response([out] * n if n > 1 else out)

    runner, port = await serve(handler)
    try:
        async with SGLangClient(f"http://127.0.0.1:{port}", retries=0) as client:
            results = await calls(client)
    finally:
        await runner.cleanup()
    return bodies, results


def _non_canonical(ids: list[int], tokenizer: Any, word: str) -> list[int]:
    """``ids`` with ``word``'s tokens spelled one character per token: the same text, ids the
    tokenizer would not produce for it (as a rollout's own tokens can be)."""
    whole = tokenizer.encode(word, add_special_tokens=False)
    at = next(k for k in range(len(ids)) if ids[k:k + len(whole)] == whole)
    chars = tokenizer.convert_tokens_to_ids(list(word))
    out = ids[:at] + chars + ids[at + len(whole):]
    assert tokenizer.decode(out) == tokenizer.decode(ids) and out != ids
    return out


def test_image_request_is_parsed_by_sglangs_own_code(model_dir, tmp_path):
    proc = vision_processor(str(model_dir))
    pad = proc.image_token_id
    png, jpeg = _image((255, 0, 0), (56, 42), "PNG"), _image((0, 160, 255), (84, 112), "JPEG")
    (tmp_path / "a.png").write_bytes(png)
    refs = [ImageRef(path=str(tmp_path / "a.png")), ImageRef(data=jpeg)]
    vp = encode_with_images(proc, "<image>left, <image>right: same colour?", refs)
    vp1 = encode_with_images(proc, "<image>leftover colour?", refs[1:])
    assert vp.image_tokens > 2 and 1 < vp1.image_tokens < vp.image_tokens, "placeholders expanded by transformers"
    odd = _non_canonical(vp1.input_ids, proc.tokenizer, "leftover")
    one = sampling_params(max_new_tokens=2, temperature=0.7, top_p=0.9, stop_token_ids=[5], sampling_seed=3)
    two = sampling_params(max_new_tokens=2, n=2, sampling_seed=4)

    async def calls(client: SGLangClient) -> list[Any]:
        return [await client.generate_with_images(vp.input_ids, refs, image_token_id=pad, sampling=one, rid="r1"),
                await client.generate_with_images(vp.input_ids, refs, image_token_id=pad, sampling=two, rid="r2"),
                await client.generate_with_images(odd, refs[1:], image_token_id=pad, sampling=two, rid="r3"),
                await client.generate(vp.input_ids, two, rid="r2")]          # the text path, for its rids

    bodies, outs = asyncio.run(_capture(calls))
    assert [len(o) for o in outs] == [1, 2, 2, 2] and outs[1][1].logprobs == [-0.5, -0.25]
    assert all(isinstance(u, str) and u.startswith("data:image/") for u in bodies[0]["image_data"])
    assert bodies[0]["image_data"][1].startswith("data:image/jpeg;base64,")
    # why the ids go collapsed: the same non-canonical ids sent expanded (a body made here)
    expanded = dict(bodies[2], input_ids=odd, rid="r4")

    done = subprocess.run([sglang_cpu_python(), "-m", "tests.helpers.sglang_vl"], capture_output=True, text=True,
                          input=json.dumps({"model_dir": str(model_dir), "bodies": bodies + [expanded]}),
                          env=harness_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["sglang"] == "0.5.23" and got["mm_processor"] == "QwenVLImageProcessor"
    single, pair, lone, text, retokenized = got["results"]
    assert all(r["contract"] is None for r in got["results"]), "SGLang's /generate schema gate admits every body"

    assert single["is_single"] and not pair["is_single"]
    assert [r["rid"] for r in pair["requests"]] == [r["rid"] for r in text["requests"]] == ["r2_0", "r2_1"]
    assert single["requests"][0]["rid"] == "r1" and [r["rid"] for r in lone["requests"]] == ["r3_0", "r3_1"]
    assert single["requests"][0]["sampling_params"] == one and single["requests"][0]["return_logprob"] is True
    for result, images, ours, grid in ((single, [png, jpeg], vp.input_ids, vp.image_grid_thw),
                                       (pair, [png, jpeg], vp.input_ids, vp.image_grid_thw),
                                       (lone, [jpeg], odd, vp1.image_grid_thw)):
        for r in result["requests"]:
            assert r["input_ids"] == collapse_image_runs(ours, pad), "one placeholder per image on the wire"
            assert [base64.b64decode(b) for b in r["images"]] == images, "the same images, byte for byte"
            assert [tuple(s) for s in r["sizes"]] == [Image.open(io.BytesIO(b)).size for b in images]
            # SGLang's Qwen2.5-VL processor: exactly our expanded ids (image token counts and grids
            # as transformers' processor gave them), non-canonical text ids kept verbatim
            assert r["mm_input_ids"] == ours
            assert r["mm_image_tokens"] == sum(1 for t in ours if t == pad)
            assert r["mm_grids"] == grid.tolist()
    drifted = retokenized["requests"][0]["mm_input_ids"]
    assert drifted != odd and proc.tokenizer.decode(drifted) == proc.tokenizer.decode(odd), \
        "SGLang decodes expanded ids and tokenizes the text again"


def test_undecodable_image_is_one_line_naming_the_request_before_sending(tmp_path):
    good = _image((1, 2, 3), (28, 28), "PNG")
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")

    async def calls(client: SGLangClient) -> list[Any]:
        errors = []
        for ids, images in (([1, 9, 2, 9, 9, 3], [good, ImageRef(data=good[:40])]),
                            ([1, 9, 9, 2], [ImageRef(path=str(tmp_path / "bad.png"))]),
                            ([9, 9], ["data:image/png;base64,@@not base64@@"]),
                            ([1, 9], [ImageRef(path=str(tmp_path / "missing.png"))]),
                            ([1, 9, 9, 2], [good, good])):
            with pytest.raises(BadImage) as caught:
                await client.generate_with_images(ids, images, image_token_id=9, rid="req-7")
            errors.append(str(caught.value))
        return errors

    bodies, errors = asyncio.run(_capture(calls))
    assert bodies == [], "nothing reaches the server"
    assert all("\n" not in e and e.startswith("generate request 'req-7': ") for e in errors), errors
    assert errors[0].startswith("generate request 'req-7': image 1 <40 bytes> is not a decodable image")
    assert "bad.png" in errors[1] and errors[2].startswith("generate request 'req-7': image 0 <data URL")
    assert "missing.png" in errors[3] and errors[3].startswith("generate request 'req-7': image 0 ")
    assert errors[4].endswith("input_ids hold 1 image placeholder run(s) (token 9) but 2 image(s) were given")
