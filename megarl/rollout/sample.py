"""One trajectory as the trainer consumes it: prompt tokens, the model's tokens exactly as the
server returned them, their rollout logprobs and the weight version that produced each of them.

A rollout source (``megarl/rollout/source.py``) yields lists of these, grouped by prompt (``group``:
the n samples of one prompt, numbered contiguously within a batch). ``versions`` is empty for
on-policy batches (every token from the weights being trained); an off-policy source fills it with
one version per response token -- a partial rollout continued after a weight update has older
versions first, then newer ones. An agent loop (multi-turn, tools; ``megarl/rollout/agent.py``) yields the same samples
whose ``response_ids`` interleave model and environment tokens: ``loss_mask`` then has one entry
per response token, 1 where the model sampled it (trained on, with its rollout logprob) and 0
where the environment wrote it (observations and the chat template's turn boundaries; logprob 0).
An empty ``loss_mask`` means every response token is the model's (single-turn).

A sample whose reward could not be computed (a scorer that raised or timed out, a judge that
answered no grade, an environment that crashed) carries a ``failure`` and a reward of nan: it is
not trained on (its loss mask is 0) and the advantage leaves it out (``megarl/rollout/failures.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megarl.data.batch import LOSS_MASK, ROUTES_KEY, TokenBatch
from megarl.rewards.failures import Failure
from megarl.rollout.routed_experts import flat_routes


@dataclass
class Sample:
    record: Any
    group: int
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    reward: float = 0.0
    text: str = ""
    versions: list[int] = field(default_factory=list)   # weight version of each response token (off-policy)
    routed_experts: Optional[torch.Tensor] = None        # MoE: int [len - 1, layers, top_k] chosen by the rollout
    loss_mask: list[int] = field(default_factory=list)   # per response token: 1 model, 0 environment (empty: all 1)
    info: dict[str, Any] = field(default_factory=dict)   # agent loop: turns, tool calls/errors, truncation
    failure: Optional[Failure] = None                    # why it has no reward (then reward is nan)

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def fail(self, failure: Failure) -> None:
        """No reward for this sample: a failure is never a score (reward nan, not 0)."""
        self.failure, self.reward = failure, float("nan")


def token_batch(samples: list[Sample], with_rollout_logprobs: bool = True,
                routes_shape: Optional[tuple[int, int]] = None) -> TokenBatch:
    """The step's samples as flat tensors (the one layout every worker call ships); MoE rollouts'
    routed experts ride along as a sequence field when any sample has them, agent trajectories'
    loss mask (1 model token, 0 environment token) as a token field -- 0 on every token of a
    failed sample (no reward: nothing to learn from it)."""
    fields = {"rollout_logprobs": [s.rollout_logprobs for s in samples]} if with_rollout_logprobs else {}
    if any(s.loss_mask or s.failed for s in samples):   # environment tokens and failed samples are not trained on
        fields[LOSS_MASK] = [[0] * len(s.response_ids) if s.failed else s.loss_mask or [1] * len(s.response_ids)
                             for s in samples]
    batch = TokenBatch.from_sequences([s.prompt_ids for s in samples], [s.response_ids for s in samples], fields or None)
    if routes_shape is not None and any(s.routed_experts is not None for s in samples):
        batch.seq_fields[ROUTES_KEY] = flat_routes([s.routed_experts for s in samples],
                                                   batch.seq_lens.tolist(), routes_shape)
    return batch
