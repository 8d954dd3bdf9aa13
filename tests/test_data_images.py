"""Images in prompt rows (megarl/data/images.py): the forms rows use, one-line errors naming the file,
line and image before anything runs, and the prompt through transformers' own Qwen2.5-VL
processor (its image processor, chat template and placeholder expansion)."""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from megarl.data.images import ImageRef, check_images_fit_model, encode_with_images, vision_processor
from megarl.data.sources import DataError, load_jsonl, load_parquet


def _png(colour=(255, 0, 0), size=(56, 42)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_paths_beside_the_file_and_image_marks(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(_png())
    f = _jsonl(tmp_path / "d.jsonl", [
        {"prompt": "<image>Which colour is the square?", "images": ["img/a.png"], "answer": "red"},
        {"prompt": "plain text row", "answer": "1"},
    ])
    recs = load_jsonl(f)
    assert recs[0].images == [ImageRef(path=str(tmp_path / "img" / "a.png"))]
    assert "images" not in recs[0].metadata and recs[1].images == []
    assert recs[0].images[0].open().getpixel((3, 3)) == (255, 0, 0)


def test_a_missing_image_names_file_line_and_image(tmp_path):
    (tmp_path / "ok.png").write_bytes(_png())
    f = _jsonl(tmp_path / "d.jsonl", [
        {"prompt": "<image>q", "images": ["ok.png"]},
        {"prompt": "<image> and <image>", "images": ["ok.png", "gone.png"]},
    ])
    with pytest.raises(DataError) as e:
        load_jsonl(f)
    msg = str(e.value)
    assert msg.startswith(f"{f}:2: image 1 ") and "gone.png" in msg and "no such file" in msg and "\n" not in msg


def test_an_unreadable_image_names_file_line_and_image(tmp_path):
    (tmp_path / "bad.png").write_bytes(b"not a png at all")
    f = _jsonl(tmp_path / "d.jsonl", [{"prompt": [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "what is it?"}]}], "images": ["bad.png"]}])
    with pytest.raises(DataError, match=rf"^{f}:1: image 0 '.*bad.png' cannot be read: UnidentifiedImageError"):
        load_jsonl(f)


def test_marks_and_images_must_agree_and_urls_are_refused(tmp_path):
    (tmp_path / "a.png").write_bytes(_png())
    f = _jsonl(tmp_path / "d.jsonl", [{"prompt": "<image><image>two", "images": ["a.png"]}])
    with pytest.raises(DataError, match=r":1: the prompt marks 2 image place\(s\).*holds 1 image"):
        load_jsonl(f)
    f = _jsonl(tmp_path / "e.jsonl", [{"prompt": "<image>x", "images": ["https://example.com/a.png"]}])
    with pytest.raises(DataError, match=r":1: image 'https://example.com/a.png' is a URL"):
        load_jsonl(f)


def test_parquet_image_structs_and_inline_parts(tmp_path):
    """HF datasets' image struct (bytes + path) in a parquet column; a data URL in an OpenAI
    ``image_url`` part; a transformers ``image`` part with bytes."""
    red, blue = _png(), _png((0, 0, 255))
    table = pa.table({"prompt": ["<image>colour?", "<image>colour?"],
                      "images": [[{"bytes": red, "path": "r.png"}], [{"bytes": blue, "path": None}]],
                      "answer": ["red", "blue"]})
    pq.write_table(table, tmp_path / "d.parquet")
    recs = load_parquet(tmp_path / "d.parquet")
    assert [r.images[0].open().getpixel((0, 0)) for r in recs] == [(255, 0, 0), (0, 0, 255)]
    url = "data:image/png;base64," + base64.b64encode(blue).decode()
    f = _jsonl(tmp_path / "d.jsonl", [{"prompt": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "colour?"}]}]}])
    assert load_jsonl(f)[0].images[0].open().getpixel((0, 0)) == (0, 0, 255)


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory):
    """A Qwen2.5-VL processor folder: SmolLM2's tokenizer with Qwen's vision tokens, and
    transformers' own Qwen2-VL image processor with a small pixel budget."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessor

    from megarl.checkpoint.smollm2 import smollm2_hf_dir
    d = tmp_path_factory.mktemp("vl")
    tok = AutoTokenizer.from_pretrained(str(smollm2_hf_dir()))
    tok.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                          "<|video_pad|>"]})
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for p in m['content'] %}"
                         "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
                         "{% else %}{{ p['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(d)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16).save_pretrained(d)
    return d


def test_prompt_through_transformers_own_processor(processor_dir, tmp_path):
    from transformers import Qwen2VLImageProcessor

    proc = vision_processor(str(processor_dir))
    (tmp_path / "a.png").write_bytes(_png(size=(56, 42)))
    (tmp_path / "b.png").write_bytes(_png((0, 255, 0), size=(84, 112)))
    f = _jsonl(tmp_path / "d.jsonl", [{"prompt": "<image>left, <image>right: same colour?",
                                       "images": ["a.png", "b.png"]}])
    rec = load_jsonl(f)[0]
    vp = encode_with_images(proc, rec.prompt, rec.images)
    own = Qwen2VLImageProcessor.from_pretrained(processor_dir)(
        images=[Image.open(tmp_path / "a.png").convert("RGB"), Image.open(tmp_path / "b.png").convert("RGB")],
        return_tensors="pt")
    assert torch.equal(vp.pixel_values, own["pixel_values"]) and torch.equal(vp.image_grid_thw, own["image_grid_thw"])
    merge = own["image_grid_thw"].prod(dim=1) // 4                # 2x2 patch merge: tokens per image
    pad = proc.image_token_id
    runs, n = [], 0
    for t in vp.input_ids + [-1]:
        if t == pad:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    assert runs == merge.tolist() and vp.image_tokens == int(merge.sum())
    text = proc.tokenizer.decode([t for t in vp.input_ids if t != pad])
    assert text.startswith("<|im_start|>user\n<|vision_start|><|vision_end|>left, <|vision_start|><|vision_end|>right")
    with pytest.raises(DataError, match=rf"{len(vp.input_ids)} prompt tokens, {vp.image_tokens} of them for 2 image"):
        encode_with_images(proc, rec.prompt, rec.images, max_prompt_tokens=len(vp.input_ids) - 1)


def test_images_for_a_text_only_model_are_refused_in_one_line(tmp_path):
    (tmp_path / "a.png").write_bytes(_png())
    recs = load_jsonl(_jsonl(tmp_path / "d.jsonl", [{"prompt": "x"}, {"prompt": "<image>q", "images": ["a.png"]}]))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(DataError, match=r"^1 prompt\(s\) hold images .*first: prompt 1.* is a text-only model"):
        check_images_fit_model(recs, model, "images")
    check_images_fit_model(recs[:1], model, "images")      # text rows: nothing to refuse
