"""A role's weights as an HF folder, written by the ranks that own them (driver side).

Each rank writes its own safetensors file (the worker's ``export_hf``); the driver adds the index,
``config.json`` (with ``config_updates``, e.g. a reward model's classifier architecture) and the
tokenizer files of the model the run started from, and publishes the folder atomically.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional

from megarl.checkpoint.atomic import replace_dir

TOKENIZER_FILES = ("tokenizer", "special_tokens", "generation_config", "vocab", "merges", "chat_template")


def export_hf_folder(group: Any, model_dir: Path, out: Path, config_updates: Optional[dict] = None) -> Path:
    """Write ``group``'s weights to ``out`` (replaced whole); returns ``out``."""
    out = Path(out)
    tmp = out.with_name("." + out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    for part in group.call("export_hf", str(tmp)):
        weight_map.update(part)
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config.update(config_updates or {})
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    for f in Path(model_dir).iterdir():
        if f.name.startswith(TOKENIZER_FILES):
            shutil.copy(f, tmp / f.name)
    replace_dir(tmp, out)
    return out


def export_peft_adapter(group: Any, lora_cfg: Any, model_dir: Path, out: Path) -> Path:
    """A LoRA actor's adapters as a PEFT adapter folder (``adapter_config.json`` +
    ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads onto the HF base
    model; the adapters are megabytes, so the driver gathers them and writes one file."""
    from megarl.models.lora import gather_peft_tensors, peft_config, spec_from_config, write_peft_folder

    out = Path(out)
    tmp = out.with_name("." + out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_peft_folder(tmp, gather_peft_tensors(group), peft_config(spec_from_config(lora_cfg),
                                                                   base_model=str(model_dir)))
    replace_dir(tmp, out)
    return out
