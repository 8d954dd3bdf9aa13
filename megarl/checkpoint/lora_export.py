"""``megarl convert lora-to-peft``: a LoRA run's checkpoint as a PEFT adapter (and, on request, the
merged HF model), without a training run.

Why a separate path from ``megatron-to-hf``: a LoRA checkpoint holds the adapters only; the base is
the HF model the run started from (``model.hf_path`` of the run's ``config.json``). One rank
builds the base, attaches adapters of the run's ``actor.lora`` shape, loads them from the
checkpoint's ``actor/`` folder (megatron's torch_dist: any TP/PP layout the run used), and writes
``adapter_config.json`` + ``adapter_model.safetensors`` (and ``--merged``: W + (alpha/r) B A in
the HF layout, held in memory once: for a 7B model that needs ~30 GB of host memory).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

from .atomic import replace_dir


def _base_dir(hf_path: str) -> Path:
    if hf_path.startswith("builtin:"):
        from .smollm2 import smollm2_hf_dir
        return Path(smollm2_hf_dir())
    return Path(hf_path).expanduser()


def _export_rank(rank: int, world: int, ckpt_actor: str, base: str, lora: dict, seed: int, out: str,
                 merged: Optional[str]) -> int:
    from types import SimpleNamespace

    from megatron.core import dist_checkpointing
    from safetensors.torch import save_file

    from megarl.models import build_model, iter_hf_weights, load_hf_weights
    from megarl.models.lora import (apply_lora, checkpoint_sharded_state, load_checkpoint_state, peft_config,
                                    peft_state_dict, spec_from_config, write_peft_folder)
    from megarl.parallel import init_model_parallel

    init_model_parallel()
    spec = spec_from_config(SimpleNamespace(**lora), seed)
    chunks = build_model(base)
    load_hf_weights(chunks, base)
    apply_lora(chunks, spec)
    loaded = dist_checkpointing.load({"model": checkpoint_sharded_state(chunks[0])}, ckpt_actor)
    load_checkpoint_state(chunks[0], loaded["model"])
    tensors = peft_state_dict(chunks)
    write_peft_folder(out, tensors, peft_config(spec, base_model=base))
    if merged:
        save_file({k: v.contiguous() for k, v in iter_hf_weights(chunks)}, str(Path(merged) / "model.safetensors"),
                  metadata={"format": "pt"})
    return len(tensors)


def convert_lora_to_peft(ckpt_dir: str, out_dir: str, merged_dir: Optional[str] = None,
                         run_config: Optional[str] = None) -> int:
    """Write the PEFT adapter of checkpoint ``ckpt_dir`` (``RUN/checkpoints/step_N``) to ``out_dir``;
    ``merged_dir``: also the merged HF model. ``run_config`` defaults to ``RUN/config.json``.
    Returns the number of adapter tensors written."""
    from megarl.parallel import spawn

    ckpt = Path(ckpt_dir)
    actor = ckpt / "actor"
    if not actor.is_dir():
        raise FileNotFoundError(f"--ckpt: {ckpt} has no actor/ folder (not a megarl training checkpoint)")
    cfg_path = Path(run_config) if run_config else ckpt.parent.parent / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"--run-config: {cfg_path} not found (the run's config.json)")
    cfg = json.loads(cfg_path.read_text())
    lora = cfg["actor"]["lora"]
    if not lora.get("rank"):
        raise ValueError(f"--ckpt: the run of {cfg_path} trained without LoRA (actor.lora.rank = 0); "
                         f"use megarl convert megatron-to-hf / the run's HF export")
    base = _base_dir(cfg["model"]["hf_path"])
    outs = [Path(out_dir)] + ([Path(merged_dir)] if merged_dir else [])
    tmps = [o.with_name("." + o.name + ".tmp") for o in outs]
    for t in tmps:
        shutil.rmtree(t, ignore_errors=True)
        t.mkdir(parents=True)
    n = spawn(_export_rank, 1, str(actor), str(base), lora, int(cfg.get("seed", 0)), str(tmps[0]),
              str(tmps[1]) if merged_dir else None)[0]
    if merged_dir:
        from .hf_export import TOKENIZER_FILES
        shutil.copy(base / "config.json", tmps[1] / "config.json")
        for f in base.iterdir():
            if f.name.startswith(TOKENIZER_FILES):
                shutil.copy(f, tmps[1] / f.name)
    for t, o in zip(tmps, outs):
        replace_dir(t, o)
    return n
