"""Runs inside the SGLang CPU environment (tests/sglang_cpu/server.py's `sglang_cpu_python`): takes
/generate JSON bodies megarl's client sent (stdin: {"model_dir", "bodies"}) and answers, as JSON on
the last stdout line, what SGLang 0.5.23's own code makes of each:

* ``contract``: `sglang.srt.entrypoints.api_contract.generate_contract_error` (the schema gate the
  /generate route runs on the raw JSON);
* the body parsed into `GenerateReqInput` by pydantic (what FastAPI does for the route's dataclass
  parameter), then `normalize_batch_and_arguments()` and `obj[i]` (as `TokenizerManager` does);
* per request: its rid, input_ids, sampling params, and each image read back by
  `sglang.srt.utils.common.get_image_bytes` (bytes, base64 here) and `load_image` (size);
* per request: SGLang's Qwen2.5-VL multimodal processor (`QwenVLImageProcessor`, chosen by
  `get_mm_processor` for the folder's config) given what `TokenizerManager._tokenize_one_request`
  gives it for a request with input_ids and no text: the input_ids it ends with (placeholders
  expanded), their image tokens, and the image grids.

Two things are not SGLang's here, because torchvision has no wheel that loads beside this CPU
torch: the `torchvision` import at the top of SGLang's qwen_vl.py is satisfied by a stand-in
(qwen_vl.py uses torchvision only to resize video frames; calling it would raise), and the
transformers processor SGLang's `get_processor` would load (`AutoProcessor`, whose Qwen2-VL video
processor needs torchvision) is megarl's `vision_processor`: transformers' own
`Qwen2_5_VLProcessor` class without the video processor.
"""
from __future__ import annotations

import asyncio
import base64
import importlib.abc
import importlib.machinery
import json
import sys
from typing import Any

import tests.sglang_cpu.stubs as stubs

stubs.install()
# transformers decides "no torchvision" before the stand-in exists (it reads the installed packages)
import transformers.models.auto.processing_auto  # noqa: E402,F401


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import torchvision`` (and its submodules) answers a stand-in whose members raise if called."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.split(".")[0] != "torchvision":
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: Any) -> Any:
        module = stubs._StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: Any) -> None:
        pass


sys.meta_path.insert(0, _TorchvisionStandIn())


def _mm_processor(model_dir: str) -> Any:
    """SGLang's multimodal processor for the folder, built as `TokenizerManager.init_tokenizer_and_processor`
    builds it (server args with megarl's --skip-tokenizer-init, published for the tokenizer role)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.managers import tokenizer_manager as tm
    from sglang.srt.managers.multimodal_processor import get_mm_processor, import_processors
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args

    from megarl.data.images import vision_processor

    args = prepare_server_args(["--model-path", model_dir, "--device", "cpu", "--skip-tokenizer-init",
                                "--disable-radix-cache"])
    publish(args, role="tokenizer")
    config = ModelConfig.from_server_args(args)
    assert config.is_multimodal, "SGLang sees the folder as a multimodal model"
    import_processors("sglang.srt.multimodal.processors")
    return get_mm_processor(config.hf_config, args, vision_processor(model_dir),
                            tm.determine_tensor_transport_mode(), model_config=config)


async def _one(mm: Any, sub: Any) -> dict[str, Any]:
    from sglang.srt.utils.common import get_image_bytes, load_image

    # TokenizerManager._tokenize_one_request: a lone image becomes a list; input_ids given, no text
    images = sub.image_data if isinstance(sub.image_data, list) else [sub.image_data]
    prompt = sub.input_ids if mm.prefer_tokenized_input and sub.input_ids is not None else (sub.text or sub.input_ids)
    out = await mm.process_mm_data_async(image_data=images, audio_data=sub.audio_data, input_text=prompt,
                                         request_obj=sub, max_req_input_len=1 << 20)
    ids = [int(t) for t in out.input_ids]
    return {"rid": sub.rid, "input_ids": list(sub.input_ids), "sampling_params": sub.sampling_params,
            "return_logprob": sub.return_logprob,
            "images": [base64.b64encode(get_image_bytes(x)).decode() for x in images],
            "sizes": [list(load_image(x, gpu_image_decode=False)[0].size) for x in images],
            "mm_input_ids": ids, "mm_image_tokens": sum(1 for t in ids if t == mm.mm_tokens.image_token_id),
            "mm_grids": [item.model_specific_data["image_grid_thw"].reshape(-1).tolist() for item in out.mm_items]}


def main() -> None:
    import pydantic

    import sglang
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers.io_struct import GenerateReqInput

    job = json.load(sys.stdin)
    mm = _mm_processor(job["model_dir"])
    adapter = pydantic.TypeAdapter(GenerateReqInput)
    results = []
    for body in job["bodies"]:
        obj = adapter.validate_python(body)
        obj.normalize_batch_and_arguments()
        subs = [obj] if obj.is_single else [obj[i] for i in range(len(obj.rid))]
        has_images = [bool(s.image_data) for s in subs]
        results.append({"contract": generate_contract_error(body), "is_single": obj.is_single,
                        "requests": [asyncio.run(_one(mm, s)) if img else {"rid": s.rid, "input_ids": list(s.input_ids)}
                                     for s, img in zip(subs, has_images)]})
    print(json.dumps({"sglang": sglang.__version__, "mm_processor": type(mm).__name__, "results": results}))


if __name__ == "__main__":
    main()
