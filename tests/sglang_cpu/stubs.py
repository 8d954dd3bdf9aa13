"""Stand-ins for the few SGLang modules that cannot import on this CPU box and are off the path the
conformance tests check (multimodal image configs that need torchvision, which has no wheel that
loads beside the CPU torch 2.13 here).

Only the modules named in `OFF_PATH` are replaced, by exact name; everything else -- SGLang's HTTP
app, argument parser, launcher, tokenizer manager, scheduler weight updater, TP worker, model-runner
weight updater, unpickler -- is SGLang's own code. A stand-in module answers any attribute: names
ending in "Config" are distinct `PretrainedConfig` subclasses (SGLang registers them by
`model_type`), anything else a callable placeholder that raises if it is ever called.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

# module -> why it cannot load here
OFF_PATH = {
    "sglang.srt.multimodal.internvl_utils": "InternVL image preprocessing (imports torchvision)",
    "sglang.srt.configs.deepseek_ocr": "DeepSeek-OCR vision config (imports torchvision)",
}


class _Unavailable:
    def __init__(self, qualname: str):
        self._qualname = qualname

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._qualname} is not available in the SGLang CPU conformance harness")

    def __getattr__(self, name: str):
        return _Unavailable(f"{self._qualname}.{name}")


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name.endswith("Config"):
            from transformers import PretrainedConfig

            value = type(name, (PretrainedConfig,), {"model_type": f"unavailable_{name.lower()}"})
        elif name.isupper():
            value = (0.0, 0.0, 0.0)  # image-normalisation constants
        else:
            value = _Unavailable(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name in OFF_PATH else None

    def create_module(self, spec):
        return _StandIn(spec.name)

    def exec_module(self, module):
        pass


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
