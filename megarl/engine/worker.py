"""What one TP rank of the embedded server holds and does, and rank 0's handle on all of them.

`RankWorker` is the same object on every rank (its model shard + weight receiver); its methods
are the only things `Lockstep` calls, so they are the complete list of what followers ever do.
`ModelHandle` gives the engine (rank 0) the model interface it always had -- `prefill`,
`decode`, `alloc_cache`, ... -- with every call going through `Lockstep` to all ranks.
`build_worker` is the one place a rank is constructed (rank 0 in `cli.py`, the others in
`follower.py`), from the same `RankOptions`.
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from .lora import AdapterError, build_adapter, read_peft_dir, verify_checksums
from .model import DecoderModel, Spec
from .shard import tp_problems
from .tp import Lockstep, TPComm, init_tp
from .unpickle import loads
from .weights import Done, WeightReceiver, resolve_disk_path

log = logging.getLogger("megarl.engine")


@dataclass
class RankOptions:
    """What every rank needs to build its part (JSON-serialisable: followers get it in argv --
    so it must never carry a secret)."""

    model: str
    device: str              # resolved: "cpu" or "cuda" (rank r then uses cuda:r) or "cuda:N" (TP 1)
    dtype: str               # resolved torch dtype name
    load_format: str = "auto"
    random_seed: int = 0
    tp_size: int = 1
    tp_port: int = 0
    weights_dir: Optional[str] = None
    num_threads: int = 0
    fp32_lm_head: bool = False          # --enable-fp32-lm-head (only rank 0 computes logits)
    return_routed_experts: bool = False  # --enable-return-routed-experts (MoE)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def rank_device(opts: RankOptions, rank: int) -> torch.device:
    if opts.device == "cuda" and opts.tp_size > 1:
        return torch.device("cuda", rank)
    return torch.device(opts.device)


def check_tp(hf_config, tp_size: int, device: str) -> Optional[str]:
    """One line saying why this server cannot run with `tp_size` ranks (None when it can);
    checked before anything is spawned or loaded."""
    spec = Spec.from_hf_config(hf_config)
    bad = tp_problems(spec, tp_size)
    if bad:
        return f"--tp-size {tp_size} does not divide {', '.join(bad)} of this model"
    if tp_size > 1 and device.startswith("cuda:"):
        return f"--device {device} cannot be combined with --tp-size {tp_size}: rank r uses cuda:r of CUDA_VISIBLE_DEVICES"
    if tp_size > 1 and device == "cuda" and torch.cuda.device_count() < tp_size:
        return f"--tp-size {tp_size} needs {tp_size} visible GPUs, CUDA_VISIBLE_DEVICES shows {torch.cuda.device_count()}"
    return None


class RankWorker:
    """One rank's model shard and weight receiver; every method runs on every rank (lockstep)."""

    def __init__(self, model: DecoderModel, receiver: WeightReceiver, comm: TPComm):
        self.model = model
        self.receiver = receiver
        self.comm = comm

    # --------------------------------------------------------------- model calls
    def alloc_cache(self, max_slots: int, max_len: int) -> None:
        self.model.alloc_cache(max_slots, max_len)

    def free_cache(self) -> None:
        self.model.free_cache()

    def prefill(self, seqs: List[List[int]], row0: int, starts: Optional[List[int]] = None,
                loras: Optional[Sequence[Optional[str]]] = None) -> Optional[torch.Tensor]:
        return self.model.prefill(seqs, row0, starts, loras)

    def decode(self, tokens: Sequence[int], positions: Sequence[int],
               loras: Optional[Sequence[Optional[str]]] = None) -> Optional[torch.Tensor]:
        return self.model.decode(tokens, positions, loras)

    def decode_launch(self, tokens: Optional[Sequence[int]], positions: Sequence[int],
                      sample: Callable[[torch.Tensor, int], torch.Tensor], sample_key: tuple = ()) -> Any:
        return self.model.decode_launch(tokens, positions, sample, sample_key)

    def copy_rows(self, src: Sequence[int], dst: Sequence[int], length: int) -> None:
        self.model.copy_rows(src, dst, length)

    def forward_full(self, ids: List[int], lora: Optional[str] = None) -> Optional[torch.Tensor]:
        return self.model.forward_full(ids, lora)

    def prompt_logprobs(self, ids: List[int], start: int, lora: Optional[str] = None) -> Optional[torch.Tensor]:
        return self.model.prompt_logprobs(ids, start, lora)

    def offload_weights(self, keep: bool = True) -> None:
        self.model.offload_weights(keep)

    def reload_weights(self) -> None:
        self.model.reload_weights()

    # --------------------------------------------------------------- weight ops
    def init_group(self, *args: Any) -> str:
        return self.receiver.init_group(*args)

    def destroy_group(self, group_name: str) -> str:
        return self.receiver.destroy_group(group_name)

    def update_from_distributed(self, *args: Any) -> Done:
        return self.receiver.from_distributed(*args)

    def update_from_tensor(self, *args: Any) -> Done:
        return self.receiver.from_tensor(*args)

    def update_from_disk(self, path: str) -> Done:
        return self.receiver.from_disk(path)

    # --------------------------------------------------------------- LoRA adapters (lora.py)
    def load_lora(self, name: str, config: Optional[Dict[str, Any]], source: Any,
                  checksums: Optional[Dict[str, str]] = None) -> str:
        """Load adapter ``name`` on every rank or on none: ``source`` is the list of per-rank
        payloads (rank r unpickles entry r only, with the allowlist) or a PEFT folder already
        resolved inside ``--weights-dir`` (its files' realpaths are checked again here)."""
        err = None
        try:
            if name in self.model.adapters:
                raise AdapterError(f"lora_name {name!r}: an adapter of this name is already loaded")
            if isinstance(source, str):
                from .lora import ADAPTER_FILE, CONFIG_FILE
                for f in (CONFIG_FILE, ADAPTER_FILE):
                    resolve_disk_path(os.path.join(source, f), self.receiver.weights_dir, "lora_path", "load_lora_adapter")
                config, tensors = read_peft_dir(source)
            else:
                tensors = loads(source[self.comm.rank])
                if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
                    raise AdapterError("serialized_named_tensors: each payload must be a pickled {name: tensor} dict")
                verify_checksums(tensors, checksums)
            adapter = build_adapter(name, config or {}, tensors, self.model)
        except (AdapterError, ValueError, FileNotFoundError) as e:
            err = str(e)
        except Exception as e:  # noqa: BLE001 - reported through agree
            err = f"{type(e).__name__}: {e}"
        self.comm.check(err, f"LoRA adapter {name!r} not loaded: ")
        self.model.adapters[name] = adapter
        return f"loaded LoRA adapter {name!r} (r={adapter.rank}, {len(adapter.pairs)} projections)"

    def unload_lora(self, name: str) -> None:
        self.model.adapters.pop(name, None)


class ModelHandle:
    """The engine's model on rank 0: local metadata, every call made on all ranks."""

    def __init__(self, lockstep: Lockstep):
        self.lockstep = lockstep
        local: DecoderModel = lockstep.target.model
        self.spec, self.cfg, self.device, self.dtype = local.spec, local.cfg, local.device, local.dtype
        self.tp_size = lockstep.comm.size

    @property
    def local(self) -> DecoderModel:
        """Rank 0's own model: read-only state every rank holds alike (flags, routes) is read here,
        without a collective."""
        return self.lockstep.target.model

    def alloc_cache(self, max_slots: int, max_len: int) -> None:
        self.lockstep.call("alloc_cache", max_slots, max_len)

    def free_cache(self) -> None:
        self.lockstep.call("free_cache")

    def prefill(self, seqs: List[List[int]], row0: int, starts: Optional[List[int]] = None,
                loras: Optional[Sequence[Optional[str]]] = None) -> torch.Tensor:
        return self.lockstep.call("prefill", seqs, row0, starts, loras)

    def decode(self, tokens: Sequence[int], positions: Sequence[int],
               loras: Optional[Sequence[Optional[str]]] = None) -> torch.Tensor:
        return self.lockstep.call("decode", tokens, positions, loras)

    @property
    def decode_launch(self) -> Optional[Callable[..., Any]]:
        """A decode step and its sampling queued as one launch -- one CUDA graph, the next step
        queued before this one's tokens reach the host, the one-pass Triton sampler -- at TP 1,
        where rank 0's model is the whole model. None at TP > 1: the followers run `decode` in
        lockstep and a sampling closure cannot reach them, so the engine decodes, then samples.
        (Until this existed the served engine -- what every run with ``rollout.engine: embedded``
        uses -- always took that second path, and the decode work measured on a bare model never
        reached it.)"""
        return self._decode_launch if self.tp_size == 1 else None

    def _decode_launch(self, tokens: Optional[Sequence[int]], positions: Sequence[int],
                       sample: Callable[[torch.Tensor, int], torch.Tensor], sample_key: tuple = ()) -> Any:
        return self.lockstep.call("decode_launch", tokens, positions, sample, sample_key)

    def can_chain(self) -> bool:
        return self.local.can_chain()

    @staticmethod
    def decode_result(handle: Any) -> Any:
        return DecoderModel.decode_result(handle)

    def uses_triton(self) -> bool:
        return self.local.uses_triton()

    def copy_rows(self, src: Sequence[int], dst: Sequence[int], length: int) -> None:
        self.lockstep.call("copy_rows", src, dst, length)

    def forward_full(self, ids: List[int], lora: Optional[str] = None) -> torch.Tensor:
        return self.lockstep.call("forward_full", ids, lora)

    def prompt_logprobs(self, ids: List[int], start: int, lora: Optional[str] = None) -> torch.Tensor:
        """Rank 0's fp32 log-probabilities of ``ids[start + 1:]`` (every TP rank runs the forward)."""
        return self.lockstep.call("prompt_logprobs", ids, start, lora)

    def unload_lora(self, name: str) -> None:
        self.lockstep.call("unload_lora", name)

    def records_routes(self) -> bool:
        return self.local.records_routes()

    def routed_experts(self, slot: int, start: int, end: int) -> torch.Tensor:
        """Read on rank 0 only (routing is replicated over TP ranks; no collective)."""
        return self.local.routed_experts(slot, start, end)

    def offload_weights(self, keep: bool = True) -> None:
        self.lockstep.call("offload_weights", keep)

    def weights_stale(self) -> bool:
        """Released without a host copy and not pushed since (rank 0's flag: every rank gets the
        same releases and updates)."""
        return self.local.weights_stale()

    def reload_weights(self) -> None:
        self.lockstep.call("reload_weights")

    def weights(self, op: str, *args: Any) -> Any:
        """A weight op (`init_group`, `update_from_tensor`, ...) on every rank."""
        return self.lockstep.call(op, *args)


def one_rank_handle(model: DecoderModel, weights_dir: Optional[str] = None) -> ModelHandle:
    """Rank 0's handle on a one-rank server around ``model``: what `megarl serve --tp-size 1` puts
    under its engine, so a benchmark or test of ``Engine(one_rank_handle(model))`` runs the served
    code path, not the bare model's."""
    comm = TPComm()
    return ModelHandle(Lockstep(RankWorker(model, WeightReceiver(model, comm, weights_dir), comm), comm))


def build_worker(opts: RankOptions, rank: int, hf_config=None) -> RankWorker:
    """Join the TP group, build this rank's shard and load its weights (checkpoint or dummy).
    Ranks load independently (no collectives), each reading the FULL tensors and keeping its
    slice."""
    if opts.num_threads:
        torch.set_num_threads(opts.num_threads)
    dev = rank_device(opts, rank)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)   # (a bare "cuda" is the current device already)
    if hf_config is None:
        from transformers import AutoConfig
        hf_config = AutoConfig.from_pretrained(opts.model)
    comm = init_tp(rank, opts.tp_size, opts.tp_port, dev)
    model = DecoderModel(hf_config, device=str(dev), dtype=getattr(torch, opts.dtype), tp_rank=rank,
                         tp_size=opts.tp_size, all_reduce=comm.all_reduce if opts.tp_size > 1 else None,
                         fp32_lm_head=opts.fp32_lm_head, record_routes=opts.return_routed_experts and rank == 0)
    if opts.load_format == "dummy":
        model.init_dummy(opts.random_seed)
    else:
        model.load_hf_dir(opts.model)
    return RankWorker(model, WeightReceiver(model, comm, opts.weights_dir), comm)

