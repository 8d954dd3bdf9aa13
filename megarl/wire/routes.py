"""SGLang's wire format of routed experts (R3), shared by the embedded server and the client.

SGLang 0.5.23 (`--enable-return-routed-experts`, request field `return_routed_experts`, optional
`routed_experts_start_len`) answers `meta_info["routed_experts"]`: the base64 of the raw bytes of
an int32 array `[seqlen - 1 - start_len, num_hidden_layers, num_experts_per_tok]` in C order
(`detokenizer_manager._b64_encode_per_request`: `pybase64.b64encode(t.numpy().tobytes())` of the
host cache rows `req_to_token[start_len : seqlen - 1]`, `state_capturer/base.py`). Row `i` is the
token at position `start_len + i` of prompt + output: every position that ran through the model
(the last sampled token never did). Layer `l` is decoder layer `l`; rows of dense layers are 0.
SGLang's own decoder (`extract_routed_experts_from_meta_info`) is `np.frombuffer(b64decode(s),
dtype=np.int32)`: the shape is not on the wire, the reader knows layers and top-k from the model.
"""
from __future__ import annotations

import base64

import numpy as np
import torch


def encode_routed_experts(routes: torch.Tensor) -> str:
    """int tensor ``[rows, layers, top_k]`` -> SGLang's base64 string of int32 bytes."""
    if routes.dim() != 3:
        raise ValueError(f"routed experts must be [rows, layers, top_k], got shape {tuple(routes.shape)}")
    array = routes.detach().to("cpu", torch.int32).contiguous().numpy()
    return base64.b64encode(array.tobytes()).decode("ascii")


def decode_routed_experts(data: str, num_layers: int, top_k: int) -> torch.Tensor:
    """SGLang's base64 string -> int32 ``[rows, num_layers, top_k]`` (rows from the length)."""
    flat = np.frombuffer(base64.b64decode(data.encode("ascii")), dtype=np.int32)
    per_row = num_layers * top_k
    if per_row <= 0 or flat.size % per_row:
        raise ValueError(f"routed experts: {flat.size} int32 values are not a whole number of rows of "
                         f"{num_layers} layers x top-k {top_k}")
    return torch.from_numpy(flat.copy()).view(-1, num_layers, top_k)
