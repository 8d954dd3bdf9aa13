"""The SGLang native HTTP API subset megarl speaks, pinned to sglang's own dataclasses.

Field names below were copied from the sglang 0.5.23 wheel
(`sglang/srt/managers/io_struct.py`, `sglang/srt/sampling/sampling_params.py`,
`sglang/srt/entrypoints/http_server.py`). `tests/test_client_fields.py` checks them against the
installed wheel's source (parsed with `ast`: importing `io_struct` needs psutil, msgspec, zmq and
the rest of sglang's runtime, which do not install on CPU CI) and against this pinned copy.

megarl extensions (ignored by real sglang, whose request schemas are built with
`extra_behavior="ignore"`; see `sglang/srt/utils/msgspec_utils.py`):
  * `megarl_checksums: List[str]` on `/update_weights_from_distributed` and
    `/update_weights_from_tensor` -- one checksum per bucket (see `megarl.sync.bucket.checksum`).
    The embedded server verifies it and refuses the bucket (old weights kept) on mismatch.
"""
from __future__ import annotations

SGLANG_VERSION = "0.5.23"

# Request dataclasses (io_struct.py) -> the fields megarl sends.  All are real sglang fields.
GENERATE_REQ_FIELDS = (
    "rid", "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "stream",
)
SAMPLING_PARAMS_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
    "min_new_tokens", "n", "ignore_eos", "skip_special_tokens", "no_stop_trim", "sampling_seed",
)
INIT_WEIGHTS_UPDATE_GROUP_FIELDS = (
    "master_address", "master_port", "rank_offset", "world_size", "group_name", "backend",
)
UPDATE_WEIGHTS_FROM_DISTRIBUTED_FIELDS = (
    "names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
    "weight_version", "load_format",
)
UPDATE_WEIGHTS_FROM_TENSOR_FIELDS = (
    "serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
    "weight_version",
)
UPDATE_WEIGHTS_FROM_DISK_FIELDS = (
    "model_path", "load_format", "abort_all_requests", "weight_version", "flush_cache",
)
BEGIN_WEIGHT_UPDATE_FIELDS = ("selector",)
END_WEIGHT_UPDATE_FIELDS = ()
PAUSE_GENERATION_FIELDS = ("mode",)
CONTINUE_GENERATION_FIELDS = ("torch_empty_cache",)
ABORT_REQ_FIELDS = ("rid", "abort_all")
RELEASE_MEMORY_FIELDS = ("tags",)
RESUME_MEMORY_FIELDS = ("tags",)

# LoRA serving (adapter-only pushes, megarl/sync/adapter.py); GenerateReqInput.lora_path selects one
LOAD_LORA_ADAPTER_FIELDS = ("lora_name", "lora_path", "pinned")
LOAD_LORA_ADAPTER_FROM_TENSORS_FIELDS = ("lora_name", "config_dict", "serialized_named_tensors", "pinned",
                                         "load_format", "expected_checksums")
UNLOAD_LORA_ADAPTER_FIELDS = ("lora_name",)
GENERATE_LORA_FIELDS = ("lora_path",)
# an adapter-only push names its version without loading weights (SGLang's /update_weight_version)
UPDATE_WEIGHT_VERSION_FIELDS = ("new_version", "abort_all_requests")

# Which sglang class each request maps to (class name in io_struct.py / sampling_params.py).
SGLANG_CLASSES = {
    "GenerateReqInput": GENERATE_REQ_FIELDS,
    "SamplingParams": SAMPLING_PARAMS_FIELDS,
    "InitWeightsUpdateGroupReqInput": INIT_WEIGHTS_UPDATE_GROUP_FIELDS,
    "UpdateWeightsFromDistributedReqInput": UPDATE_WEIGHTS_FROM_DISTRIBUTED_FIELDS,
    "UpdateWeightsFromTensorReqInput": UPDATE_WEIGHTS_FROM_TENSOR_FIELDS,
    "UpdateWeightFromDiskReqInput": UPDATE_WEIGHTS_FROM_DISK_FIELDS,
    "BeginWeightUpdateReqInput": BEGIN_WEIGHT_UPDATE_FIELDS,
    "EndWeightUpdateReqInput": END_WEIGHT_UPDATE_FIELDS,
    "PauseGenerationReqInput": PAUSE_GENERATION_FIELDS,
    "ContinueGenerationReqInput": CONTINUE_GENERATION_FIELDS,
    "AbortReq": ABORT_REQ_FIELDS,
    "ReleaseMemoryOccupationReqInput": RELEASE_MEMORY_FIELDS,
    "ResumeMemoryOccupationReqInput": RESUME_MEMORY_FIELDS,
    "LoadLoRAAdapterReqInput": LOAD_LORA_ADAPTER_FIELDS,
    "LoadLoRAAdapterFromTensorsReqInput": LOAD_LORA_ADAPTER_FROM_TENSORS_FIELDS,
    "UnloadLoRAAdapterReqInput": UNLOAD_LORA_ADAPTER_FIELDS,
    "UpdateWeightVersionReqInput": UPDATE_WEIGHT_VERSION_FIELDS,
}

# megarl's own extension fields (not in sglang; sglang ignores unknown fields).
CHECKSUM_FIELD = "megarl_checksums"
EXTENSION_FIELDS = {
    "UpdateWeightsFromDistributedReqInput": (CHECKSUM_FIELD,),
    "UpdateWeightsFromTensorReqInput": (CHECKSUM_FIELD,),
}

# `load_format` value under which sglang receives ONE flat uint8 tensor per call whose bytes are
# the named tensors back to back, in `names` order (sglang/srt/weight_sync/tensor_bucket.py).
FLATTENED_BUCKET = "flattened_bucket"

# Endpoints: (method, path).
ENDPOINTS = {
    "generate": ("POST", "/generate"),
    "init_weights_update_group": ("POST", "/init_weights_update_group"),
    "destroy_weights_update_group": ("POST", "/destroy_weights_update_group"),
    "update_weights_from_distributed": ("POST", "/update_weights_from_distributed"),
    "update_weights_from_tensor": ("POST", "/update_weights_from_tensor"),
    "update_weights_from_disk": ("POST", "/update_weights_from_disk"),
    "flush_cache": ("POST", "/flush_cache"),
    "release_memory_occupation": ("POST", "/release_memory_occupation"),
    "resume_memory_occupation": ("POST", "/resume_memory_occupation"),
    "health": ("GET", "/health"),
    "get_model_info": ("GET", "/get_model_info"),
    "begin_weight_update": ("POST", "/begin_weight_update"),
    "end_weight_update": ("POST", "/end_weight_update"),
    "pause_generation": ("POST", "/pause_generation"),
    "continue_generation": ("POST", "/continue_generation"),
    "abort_request": ("POST", "/abort_request"),
    "load_lora_adapter": ("POST", "/load_lora_adapter"),
    "load_lora_adapter_from_tensors": ("POST", "/load_lora_adapter_from_tensors"),
    "unload_lora_adapter": ("POST", "/unload_lora_adapter"),
    "update_weight_version": ("POST", "/update_weight_version"),
}

# Response shape of /generate (tokenizer_manager.py): {"text"?, "output_ids": [...],
# "meta_info": {"id", "finish_reason": {"type": "stop", "matched": tok} | {"type": "length",
# "length": n} | {"type": "abort", "message": ...}, "prompt_tokens", "completion_tokens",
# "cached_tokens", "weight_version", "output_token_logprobs": [[logprob, token_id, text|None], ...]}}
# A single prompt with n > 1, or a batch of prompts, answers a JSON list (prompt-major).
# With return_logprob and logprob_start_len s >= 0 (a teacher scoring given tokens, max_new_tokens 0),
# "input_token_logprobs" lists input positions s .. end the same way, the first entry's logprob None.
OUTPUT_TOKEN_LOGPROBS = "output_token_logprobs"
INPUT_TOKEN_LOGPROBS = "input_token_logprobs"
