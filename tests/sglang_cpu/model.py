"""The one replaced part of the SGLang CPU harness: the model behind SGLang's weight updater.

SGLang's model-runner `WeightUpdater` hands every update to `model.load_weights(named_tensors)`
with FULL HF-named tensors on every TP rank (each SGLang model class then narrows them to its
shard). `HarnessModel.load_weights` follows the contract of SGLang's Llama/Qwen2 classes where it
is visible to a trainer: tied `lm_head.weight` skipped, an unknown name raises (their
`params_dict[name]` KeyError), a shape mismatch raises. The weights are held by megarl's
embedded `DecoderModel` (one full copy per TP rank), which generates.

For the tests, each rank also writes what arrived -- a sha256 per tensor name, rank and update
number -- to `$SGLANG_CPU_RECORD_DIR/rank{r}.jsonl` when that variable is set.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable, Tuple

import torch

from megarl.engine.model import DecoderModel


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in its own dtype (what the trainer's copy must equal)."""
    return hashlib.sha256(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


class HarnessModel(torch.nn.Module):
    def __init__(self, hf_config, tp_rank: int, dtype: torch.dtype):
        super().__init__()
        self.decoder = DecoderModel(hf_config, device="cpu", dtype=dtype)
        self.tp_rank = tp_rank
        self.num_loads = 0
        self._record = os.environ.get("SGLANG_CPU_RECORD_DIR")

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        arrived = {}
        for name, tensor in weights:
            if self.decoder.is_ignored(name):
                continue
            dst = self.decoder.target(name)
            if dst is None:
                raise KeyError(name)
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
            dst.copy_(tensor.to(dst.dtype))
            if self._record:
                arrived[name] = [str(tensor.dtype).replace("torch.", ""), tensor_digest(tensor)]
        self.num_loads += 1
        self.decoder.mark_weights_changed()   # a block-FP8 model recomputes its dequantized weights
        if self._record and arrived:
            os.makedirs(self._record, exist_ok=True)
            with open(os.path.join(self._record, f"rank{self.tp_rank}.jsonl"), "a") as f:
                f.write(json.dumps({"load": self.num_loads, "pid": os.getpid(), "tensors": arrived}) + "\n")

    def weights_digest(self) -> str:
        """One digest of every served weight: TP ranks must agree before they generate."""
        h = hashlib.sha256()
        for name in sorted(self.decoder.params):
            h.update(tensor_digest(self.decoder.params[name]).encode())
        return h.hexdigest()
