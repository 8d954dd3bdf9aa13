"""Images in prompt rows: where a row keeps them, checking every one at load, and turning a prompt
with images into the token ids and pixel tensors a vision-language model takes.

A row carries its images in one of the forms vision-language datasets use:

* an ``images`` column (``data.image_key``) beside the prompt: file paths (relative to the data
  file's folder), HF datasets' image structs ``{"bytes": ..., "path": ...}`` (parquet), or
  ``data:image/...;base64,`` URLs; the prompt marks where each goes with ``<image>`` in a text
  (verl's geo3k layout) or with ``{"type": "image"}`` content parts, in order;
* chat messages whose content parts hold the image itself: ``{"type": "image", "image": ...}``
  (transformers' chat templates) or ``{"type": "image_url", "image_url": {"url": ...}}`` (OpenAI).

Every image is opened and decoded when the data is loaded, before any worker starts: a missing,
unreadable or unplaced image is a one-line `DataError` naming ``FILE:LINE`` and the image. Images
are kept as they were given (path or bytes), not decoded, until a batch needs them.

The pixels, the grid sizes and the placeholder expansion are transformers' own (the model's
processor, `encode_with_images`); nothing here resizes or patches an image.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from megarl.data.sources import DataError

IMAGE_MARK = "<image>"
_DATA_URL = re.compile(r"^data:image/[\w.+-]+;base64,(.*)$", re.S)


@dataclass(frozen=True)
class ImageRef:
    """One image as the data gave it: an absolute file path or the encoded bytes."""

    path: Optional[str] = None
    data: Optional[bytes] = None

    @property
    def label(self) -> str:
        return repr(self.path) if self.path else f"<{len(self.data or b'')} bytes>"

    def open(self) -> Any:
        """The decoded image (PIL, RGB)."""
        from PIL import Image

        img = Image.open(self.path) if self.path else Image.open(io.BytesIO(self.data or b""))
        img.load()
        return img.convert("RGB")


def _ref(value: Any, base_dir: Path, where: str) -> ImageRef:
    """An `ImageRef` from one image value of a row (path, bytes, HF image struct or data URL)."""
    if isinstance(value, dict) and ("bytes" in value or "path" in value):      # HF datasets' Image feature
        if value.get("bytes"):
            return ImageRef(data=bytes(value["bytes"]))
        value = value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return ImageRef(data=bytes(value))
    if not isinstance(value, str) or not value:
        raise DataError(f"{where}: an image must be a path, bytes or a data:image URL, got {type(value).__name__}")
    m = _DATA_URL.match(value)
    if m:
        try:
            return ImageRef(data=base64.b64decode(m.group(1), validate=True))
        except (binascii.Error, ValueError):
            raise DataError(f"{where}: image data URL is not valid base64") from None
    if "://" in value:
        raise DataError(f"{where}: image {value!r} is a URL; megarl reads images from files or inline bytes only "
                        f"(download them first)")
    path = Path(value) if os.path.isabs(value) else base_dir / value
    return ImageRef(path=str(path))


def _part_image(part: dict[str, Any]) -> Any:
    """The image value a content part holds itself (None: a bare ``{"type": "image"}`` placeholder)."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    return part.get("image") or part.get("url") or part.get("path")


def _placeholders(prompt: Any) -> tuple[int, list[Any]]:
    """(placeholders to fill from the images column, images the messages hold themselves) of a prompt."""
    if isinstance(prompt, str):
        return prompt.count(IMAGE_MARK), []
    marks, inline = 0, []
    for message in prompt:
        content = message.get("content")
        if isinstance(content, str):
            marks += content.count(IMAGE_MARK)
            continue
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") in ("image", "image_url"):
                value = _part_image(part)
                if value is None:
                    marks += 1
                else:
                    inline.append(value)
    return marks, inline


def row_images(row: dict[str, Any], prompt: Any, image_key: str, base_dir: Path, where: str) -> list[ImageRef]:
    """The images of one row, in prompt order, each checked to open and decode."""
    column = row.get(image_key)
    if column is not None and not isinstance(column, list):
        column = [column]
    marks, inline = _placeholders(prompt)
    if column is None and not inline:
        return []                       # a text row (an "<image>" in its text stays text)
    given = list(column or [])
    if inline and (given or marks):
        raise DataError(f"{where}: the messages hold images and also mark places for field {image_key!r}; use one form")
    if marks != len(given):
        raise DataError(f"{where}: the prompt marks {marks} image place(s) ({IMAGE_MARK!r} or {{'type': 'image'}} "
                        f"parts) but field {image_key!r} holds {len(given)} image(s)")
    refs = [_ref(v, base_dir, where) for v in (inline or given)]
    for i, ref in enumerate(refs):
        try:
            ref.open()
        except FileNotFoundError:
            raise DataError(f"{where}: image {i} {ref.label}: no such file") from None
        except Exception as err:  # noqa: BLE001 - PIL raises many types for a bad file
            raise DataError(f"{where}: image {i} {ref.label} cannot be read: {type(err).__name__}: {err}") from None
    return refs


def chat_messages(prompt: Any) -> list[dict[str, Any]]:
    """The prompt as chat messages with one ``{"type": "image"}`` part where each image goes (the
    form transformers' chat templates expand into the model's vision tokens)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    out = []
    for message in messages:
        content = message["content"]
        parts: list[dict[str, Any]] = []
        if isinstance(content, str):
            pieces = content.split(IMAGE_MARK)
            for k, text in enumerate(pieces):
                if k:
                    parts.append({"type": "image"})
                if text:
                    parts.append({"type": "text", "text": text})
        else:
            for part in content:
                if part.get("type") in ("image", "image_url"):
                    parts.append({"type": "image"})
                else:
                    parts.append(part)
        out.append({**message, "content": parts})
    return out


@dataclass
class VisionPrompt:
    """A prompt with images, as the model takes it."""

    input_ids: list[int]            # placeholders already expanded: one id per vision token
    pixel_values: torch.Tensor      # [patches, channels * temporal * patch * patch]
    image_grid_thw: torch.Tensor    # [images, 3]: each image's (temporal, height, width) patch grid
    image_tokens: int               # vision tokens in input_ids


def encode_with_images(processor: Any, prompt: Any, images: list[ImageRef], *, max_prompt_tokens: Optional[int] = None,
                       where: str = "prompt") -> VisionPrompt:
    """Token ids and pixels of one prompt through the model's own processor (its chat template,
    image processor and placeholder expansion). ``max_prompt_tokens``: refuse a prompt whose
    expanded length does not fit, naming how many of its tokens are the images'."""
    text = processor.apply_chat_template(chat_messages(prompt), tokenize=False, add_generation_prompt=True)
    out = processor(text=[text], images=[ref.open() for ref in images] or None, return_tensors="pt")
    ids = [int(t) for t in out["input_ids"][0]]
    image_id = getattr(processor, "image_token_id", None)
    n_image = sum(1 for t in ids if t == image_id) if image_id is not None else 0
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        raise DataError(f"{where}: {len(ids)} prompt tokens, {n_image} of them for {len(images)} image(s), exceed "
                        f"the {max_prompt_tokens} allowed (rollout.max_prompt_tokens); lower the processor's "
                        f"max_pixels or raise the limit")
    pixels = out.get("pixel_values")
    grid = out.get("image_grid_thw")
    return VisionPrompt(input_ids=ids, pixel_values=pixels if pixels is not None else torch.empty(0),
                        image_grid_thw=grid if grid is not None else torch.empty(0, 3, dtype=torch.long),
                        image_tokens=n_image)


def vision_processor(model_dir: str) -> Any:
    """The model's own processor from its folder (``AutoProcessor``). transformers 5 builds the
    Qwen2-VL family's processor with a video processor that needs torchvision; without it, the
    same processor class is built with its image processor and tokenizer only (its own ``__call__``
    and placeholder expansion; videos are refused)."""
    from transformers import AutoProcessor

    try:
        proc = AutoProcessor.from_pretrained(model_dir)
        if getattr(proc, "image_processor", None) is not None:
            return proc
        first: Exception = ValueError("AutoProcessor found no image processor")
    except (ImportError, AttributeError, ValueError, OSError) as err:
        first = err
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
        """Qwen2.5-VL's processor without its video processor (no torchvision)."""

        attributes = ["image_processor", "tokenizer"]

        def __init__(self, image_processor: Any, tokenizer: Any, chat_template: Optional[str] = None) -> None:
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)

    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
        images = AutoImageProcessor.from_pretrained(model_dir)
    except (OSError, ValueError) as err:
        raise DataError(f"{model_dir}: no image processor for this model ({first}; {err})") from None
    return ImageOnlyQwen2_5_VLProcessor(images, tok, chat_template=getattr(tok, "chat_template", None))


def check_images_fit_model(records: list[Any], model_dir: Any, image_key: str) -> None:
    """Refuse images for a model that cannot see them, before any worker starts: a text-only
    checkpoint (no ``vision_config`` in its config.json) given rows with images, in one line
    naming the first such row. The trainer's rollout and loss do not take images yet, so a
    vision-language checkpoint with images is refused the same way, saying so."""
    first = next((r for r in records if getattr(r, "images", None)), None)
    if first is None:
        return
    import json

    cfg_path = Path(model_dir) / "config.json"
    vision = False
    if cfg_path.is_file():
        vision = "vision_config" in json.loads(cfg_path.read_text())
    count = sum(1 for r in records if getattr(r, "images", None))
    if not vision:
        raise DataError(f"{count} prompt(s) hold images (field {image_key!r}, first: prompt {first.index}) but "
                        f"{model_dir} is a text-only model (its config.json has no vision_config)")
    raise DataError(f"{count} prompt(s) hold images (first: prompt {first.index}): training a vision-language "
                    f"policy on them is not supported by the trainer yet (the data path and the Qwen2.5-VL model "
                    f"are; rollout and loss with images are not)")
