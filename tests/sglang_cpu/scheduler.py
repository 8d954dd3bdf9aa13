"""SGLang's scheduler process on CPU with the model replaced: the `run_scheduler_process_func`
that `sglang.srt.entrypoints.http_server.launch_server` accepts as its documented override point.

What runs here is SGLang 0.5.23's own code wherever a trainer's request goes:
  * `publish` / `configure_scheduler_process` (the process's runtime context),
  * `bootstrap.init_parallel_runtime` -- SGLang's torch.distributed world and TP groups (gloo),
  * `SchedulerIpcChannels` and `SchedulerRequestReceiver` (zmq from the tokenizer manager, rank 0
    broadcasting every request to the other TP ranks over the TP CPU group),
  * `SchedulerWeightUpdaterManager` (sessions, barriers, version, flush), `TpModelWorker`'s
    update-group and `deserialize_own_rank` methods, the model runner's `WeightUpdater`
    (custom process groups, flattened-bucket receive, tensor and disk updates),
  * `ChecksumInfo`-free control outputs sent back through SGLang's `SenderWrapper`.
Replaced: the model runner (its GPU model, memory pools and CUDA graphs) by `CpuModelRunner`,
whose model is `HarnessModel` (megarl's embedded decoder), and batch scheduling of generation by
megarl's embedded engine on TP rank 0; generation results go back as SGLang's own
`BatchTokenIDOutput` (the `--skip-tokenizer-init` path), which SGLang's tokenizer manager turns
into the `/generate` response. Before every generation batch all TP ranks compare a digest of
their weights: an update that reached one rank and not another fails the request.

Pause, abort and weight versions follow SGLang's scheduler (`scheduler.py`): `AbortReq` finishes
the matching requests (rid prefix, or all) with `FINISH_ABORT` and the tokens they have;
`PauseGenerationReqInput` (`retract` | `in_place`; `abort` never reaches the scheduler) stops
scheduling, `retract` sending running requests back to the queue with their KV freed;
`ContinueGenerationReqInput` resumes; a weight-version change records, for every live request,
how many tokens the old version produced, and finished outputs carry SGLang's own
`compute_weight_version_spans`. The cache flush after an update succeeds only when nothing runs
(queued requests ignored while paused), as SGLang's `flush_cache` decides.
"""
from __future__ import annotations

import logging
import queue
import signal
import traceback
from array import array
from typing import Any, List, Optional

import torch

log = logging.getLogger("sglang_cpu")


class CpuModelRunner:
    """What SGLang's weight path needs of a ModelRunner: `model`, `weight_updater`."""

    def __init__(self, model_config: Any, tp_rank: int, dtype: torch.dtype):
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
        from sglang.srt.runtime_context import get_model

        from tests.sglang_cpu.model import HarnessModel

        self.model_config = model_config
        self.model = HarnessModel(model_config.hf_config, tp_rank, dtype)
        self.device = "cpu"
        self.weight_updater = WeightUpdater(
            tp_rank=tp_rank, device="cpu", gpu_id=0, model_config=model_config,
            custom_weight_loaders=get_model().custom_weight_loader, get_model=lambda: self.model,
            update_model_fields=self._update_model_fields, recapture_cuda_graph=lambda: None,
            get_model_runner=lambda: self)

    def _update_model_fields(self, model, **fields) -> None:
        self.model = model


def _tp_worker(runner: CpuModelRunner):
    """A real TpModelWorker whose model runner is ours (its update-group and deserialize
    methods are the ones under test); built without its GPU constructor."""
    from sglang.srt.managers.tp_worker import TpModelWorker

    worker = TpModelWorker.__new__(TpModelWorker)
    worker._model_runner = runner
    return worker


class CpuScheduler:
    def __init__(self, server_args: Any, port_args: Any):
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.distributed import bootstrap
        from sglang.srt.managers.io_struct import (
            AbortReq, BatchTokenizedGenerateReqInput, BeginWeightUpdateReqInput, ContinueGenerationReqInput,
            DestroyWeightsUpdateGroupReqInput, EndWeightUpdateReqInput, FlushCacheReqInput, FlushCacheReqOutput, FreezeGCReq,
            GetInternalStateReq, GetInternalStateReqOutput,
            InitWeightsUpdateGroupReqInput, PauseGenerationReqInput, ReleaseMemoryOccupationReqInput,
            ResumeMemoryOccupationReqInput, TokenizedGenerateReqInput, UpdateWeightFromDiskReqInput,
            UpdateWeightsFromDistributedReqInput, UpdateWeightsFromTensorReqInput)
        from sglang.srt.managers.scheduler_components.ipc_channels import SchedulerIpcChannels
        from sglang.srt.managers.scheduler_components.request_receiver import SchedulerRequestReceiver
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
        from sglang.srt.runtime_context import get_parallel, get_serving
        from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter
        from sglang.utils import TypeBasedDispatcher

        self.server_args = server_args
        self.model_config = ModelConfig.from_server_args(server_args)
        bootstrap.init_parallel_runtime(server_args=server_args, device="cpu", dist_port=port_args.nccl_port)
        self.tp_rank = get_parallel().tp_rank
        self.tp_group = get_parallel().tp_group.cpu_group if get_parallel().tp_size > 1 else None
        self.ipc = SchedulerIpcChannels.create(port_args=port_args, is_rank_zero=self.tp_rank == 0,
                                               skip_tokenizer_init=get_serving().skip_tokenizer_init,
                                               metrics_enabled=False, enable_scripted_runtime=False)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
            str(server_args.dtype), torch.float32)
        self.runner = CpuModelRunner(self.model_config, self.tp_rank, dtype)
        self.receiver = SchedulerRequestReceiver(
            recv_from_tokenizer=self.ipc.recv_from_tokenizer, recv_from_rpc=self.ipc.recv_from_rpc,
            recv_skipper=None, input_blocker=None, mm_receiver=None, server_args=server_args,
            model_config=self.model_config, max_recv_per_poll=-1, stream_output=lambda *a, **k: None,
            get_last_batch=lambda: None)
        self.weight_updater = SchedulerWeightUpdaterManager(
            tp_worker=_tp_worker(self.runner), draft_worker=None,
            memory_saver_adapter=TorchMemorySaverAdapter.create(enable=False), flush_cache=self.flush_cache,
            is_fully_idle=self.is_fully_idle, scheduler=self)
        self.engine = None
        if self.tp_rank == 0:
            from megarl.engine.engine import Engine

            self.engine = Engine(self.runner.model.decoder, max_running=server_args.max_running_requests or 16,
                                 max_len=self.model_config.context_len, seed=server_args.random_seed or 0)
            self.engine.weight_version = get_serving().weight_version
            self.engine.start()
        self.finished: "queue.Queue[tuple]" = queue.Queue()
        self.in_flight = 0
        self._engine_paused = False   # the attribute SGLang's weight updater reads
        wu = self.weight_updater
        self.dispatch = TypeBasedDispatcher([
            (TokenizedGenerateReqInput, self.generate),
            (BatchTokenizedGenerateReqInput, lambda batch: [self.generate(r) for r in batch] and None),
            (FlushCacheReqInput, lambda req: FlushCacheReqOutput(success=self.flush_cache())),
            (AbortReq, self.abort),
            (UpdateWeightFromDiskReqInput, wu.update_weights_from_disk),
            (InitWeightsUpdateGroupReqInput, wu.init_weights_update_group),
            (DestroyWeightsUpdateGroupReqInput, wu.destroy_weights_update_group),
            (BeginWeightUpdateReqInput, wu.begin_weight_update),
            (EndWeightUpdateReqInput, wu.end_weight_update),
            (UpdateWeightsFromDistributedReqInput, wu.update_weights_from_distributed),
            (UpdateWeightsFromTensorReqInput, wu.update_weights_from_tensor),
            (ReleaseMemoryOccupationReqInput, wu.release_memory_occupation),
            (ResumeMemoryOccupationReqInput, wu.resume_memory_occupation),
            (PauseGenerationReqInput, self.pause),
            (ContinueGenerationReqInput, self.resume),
            (FreezeGCReq, lambda req: None),
            (GetInternalStateReq, lambda req: GetInternalStateReqOutput(internal_state=self.internal_state())),
        ])
        self.dispatch.add_fallback_fn(lambda req: log.warning("CPU scheduler ignores %s", type(req).__name__))

    # ------------------------------------------------------------------ what SGLang's updater asks
    def flush_cache(self, empty_cache: bool = True) -> bool:
        return self.is_fully_idle(ignore_waiting=self._engine_paused)

    def is_fully_idle(self, for_health_check: bool = False, ignore_waiting: bool = False) -> bool:
        return self.engine is None or self._on_engine(lambda: self.engine.idle(ignore_waiting))

    def _on_engine(self, fn):
        """Run fn on the engine thread between decode steps (SGLang's scheduler is one thread)."""
        return self.engine.control(fn).result(timeout=60)

    def record_weight_version_change(self, new_version: Optional[str]) -> None:
        from sglang.srt.runtime_context import get_context, get_serving

        if new_version is not None and new_version != get_serving().weight_version:
            get_context().override("scheduler.weight_version", weight_version=new_version)
            if self.engine is not None:
                self._on_engine(lambda: self.engine.set_weight_version(new_version))

    def abort(self, req) -> None:
        if self.engine is not None:
            self._on_engine(lambda: self.engine.abort(req.rid or "", bool(req.abort_all)))

    def pause(self, req) -> None:
        assert req.mode in ("in_place", "retract")   # as SGLang's Scheduler.pause_generation
        self._engine_paused = True
        if self.engine is not None:
            self._on_engine(lambda: self.engine.pause(req.mode))

    def resume(self, req) -> None:
        if self.engine is not None:
            self._on_engine(self.engine.unpause)
        self._engine_paused = False

    def internal_state(self) -> dict:
        """SGLang's scheduler answers ``GetInternalStateReq`` (``/server_info``'s ``internal_states``)
        with its state; this one's is the requests its engine holds (``Engine.requests``), which
        tests wait on instead of sleeping."""
        if self.engine is None:
            return {}
        return {"megarl_requests": self.engine.control(self.engine.requests, new_epoch=False).result(timeout=60)}

    def init_info(self) -> dict:
        return {"status": "ready", "max_total_num_tokens": 1 << 20,
                "max_req_input_len": self.model_config.context_len - 1, "startup_time": 0.0}

    # ------------------------------------------------------------------ generation
    def _check_ranks_agree(self) -> None:
        if self.tp_group is None:
            return
        import torch.distributed as dist

        digests: List[Optional[str]] = [None] * dist.get_world_size(self.tp_group)
        dist.all_gather_object(digests, self.runner.model.weights_digest(), group=self.tp_group)
        if len(set(digests)) != 1:
            raise RuntimeError(f"TP ranks hold different weights: {digests}")

    def generate(self, req) -> None:
        self._check_ranks_agree()
        if self.engine is None:
            return None
        from megarl.engine.engine import Request, Sampling

        sp = req.sampling_params
        top_k = int(sp.top_k) if sp.top_k is not None and 0 < int(sp.top_k) < (1 << 30) else -1
        seed = sp.sampling_seed if self.server_args.enable_deterministic_inference else None
        sampling = Sampling(max_new_tokens=int(sp.max_new_tokens if sp.max_new_tokens is not None else 128),
                            temperature=float(sp.temperature), top_p=float(sp.top_p), top_k=top_k,
                            min_p=float(sp.min_p), min_new_tokens=int(sp.min_new_tokens or 0),
                            stop_token_ids=tuple(sp.stop_token_ids or ()), ignore_eos=bool(sp.ignore_eos),
                            sampling_seed=seed)
        request = Request(input_ids=[int(t) for t in req.input_ids], sampling=sampling,
                          return_logprob=bool(req.return_logprob), rid=req.rid)
        self.in_flight += 1
        engine = self.engine   # the callback runs on the engine thread: the version it finished under
        self.engine.submit(request).add_done_callback(
            lambda fut: self.finished.put((req, request, fut, engine.weight_version)))
        return None

    def _send_finished(self) -> None:
        from sglang.srt.managers.io_struct import BatchTokenIDOutput
        from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, FINISH_MATCHED_TOKEN
        from sglang.srt.utils.weight_versions import WeightVersionEvent, compute_weight_version_spans

        while True:
            try:
                req, request, fut, version = self.finished.get_nowait()
            except queue.Empty:
                return
            self.in_flight -= 1
            error = fut.exception()
            reason = request.finish_reason or {}
            if error is not None:
                finish = FINISH_ABORT(message=f"generation failed: {error}").to_json()
            elif reason.get("type") == "abort":
                finish = FINISH_ABORT().to_json()
            elif reason.get("type") == "stop":
                finish = FINISH_MATCHED_TOKEN(matched=reason.get("matched")).to_json()
            else:
                finish = FINISH_LENGTH(length=int(reason.get("length", len(request.output_ids)))).to_json()
            ids = array("q", request.output_ids)
            lps = list(request.logprobs) if req.return_logprob else None
            out = BatchTokenIDOutput(
                rids=[req.rid], http_worker_ipcs=[req.http_worker_ipc], finished_reasons=[finish],
                decoded_texts=[""], decode_ids=[ids], read_offsets=[0], output_ids=[ids],
                skip_special_tokens=[True], spaces_between_special_tokens=[True], no_stop_trim=[False],
                prompt_tokens=[len(request.input_ids)], reasoning_tokens=[0],
                completion_tokens=[len(request.output_ids)], cached_tokens=[0],
                input_token_logprobs_val=[], input_token_logprobs_idx=[],
                output_token_logprobs_val=[lps] if lps is not None else [],
                output_token_logprobs_idx=[list(request.output_ids)] if lps is not None else [],
                input_top_logprobs_val=[], input_top_logprobs_idx=[], output_top_logprobs_val=[],
                output_top_logprobs_idx=[], input_token_ids_logprobs_val=[], input_token_ids_logprobs_idx=[],
                output_token_ids_logprobs_val=[], output_token_ids_logprobs_idx=[], output_token_entropy_val=None,
                output_token_sampling_mask=None, output_hidden_states=[], routed_experts=None, indexer_topk=None,
                placeholder_tokens_idx=None, placeholder_tokens_val=None, retraction_counts=[0],
                weight_versions=[compute_weight_version_spans(
                    [WeightVersionEvent(old_version=v, num_output_tokens=k) for v, k in request.version_events],
                    current_version=version, num_output_tokens=len(request.output_ids))])
            self.ipc.send_to_detokenizer.send_output(out, req)

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        import time

        while True:
            for req in self.receiver.recv_requests():
                output = self.dispatch(req)
                if output is not None and self.tp_rank == 0:
                    self.ipc.send_to_tokenizer.send_output(output, req)
            if self.tp_rank == 0:
                self._send_finished()
            time.sleep(0.001)


def run_cpu_scheduler_process(server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, pipe_writer,
                              display_tp_rank=None, display_dp_rank=None, display_moe_ep_rank=None) -> None:
    """Same signature and start-up handshake as `sglang.srt.managers.scheduler.run_scheduler_process`."""
    import psutil
    from sglang.srt.managers.scheduler import configure_scheduler_process
    from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank

    import tests.sglang_cpu.stubs as stubs

    stubs.install()
    publish(server_args, role="scheduler",
            ranks=SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=pp_rank),
                             dp_rank=dp_rank, gpu_id=gpu_id))
    configure_scheduler_process(server_args, gpu_id)
    torch.set_num_threads(1)
    parent = psutil.Process().parent()
    try:
        scheduler = CpuScheduler(server_args, port_args)
        pipe_writer.send(scheduler.init_info())
        scheduler.run()
    except Exception:
        log.error("CPU scheduler failed: %s", traceback.format_exc())
        parent.send_signal(signal.SIGQUIT)
