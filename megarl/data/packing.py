"""Which samples each data-parallel rank gets, and how it groups them into micro-batches.

Pure functions over sequence lengths (no torch.distributed, no Ray), computed once on the driver:

* :func:`split_contiguous` splits a mini-batch (in its given, shuffled order) over data-parallel
  ranks at token-count boundaries, so every rank has the same number of tokens to within one
  sample: ranks finish together instead of all waiting for the one that drew the long responses.
  Contiguous pieces keep a forward pass's shards zero-copy views of the batch on the driver.
* :func:`pack_bins` groups one rank's samples into packed micro-batches of at most ``max_tokens``
  tokens (best-fit decreasing; a sample longer than the budget gets a micro-batch of its own).
* :func:`split_by_token_budget` / :func:`split_fixed` group samples for *padded* micro-batches
  (``packing: false``), where a micro-batch costs ``samples x longest``.
* :func:`plan_shards` puts these together per mini-batch and gives every rank the same number of
  micro-batches: megatron's expert-parallel all-to-all and the pipeline schedule run one exchange
  per micro-batch, so a rank with fewer micro-batches would leave the others waiting forever. Ranks
  short of micro-batches split their largest one; a rank with too few samples gets empty ones
  (the worker runs them as a one-token forward that adds nothing to the loss).
* :func:`stratified_minibatches` / :func:`plan_ranges` plan a training epoch over the forward
  pass's contiguous ranges: each rank shuffles its own range and cuts it into the mini-batches, so
  every rank's training shard is one contiguous range too (a view on the driver, no gather).
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field
from typing import Sequence

import torch


def balance(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of ``lengths`` split into ``parts`` lists with near-equal token sums (LPT)."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    heap = [(0, p) for p in range(parts)]
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in order:
        load, p = heapq.heappop(heap)
        out[p].append(i)
        heapq.heappush(heap, (load + int(lengths[i]), p))
    return out


def split_contiguous(lengths: Sequence[int], parts: int) -> list[range]:
    """``parts`` consecutive index ranges with near-equal token sums (cut where the running total
    crosses each ``k / parts`` of the whole; every piece is within one sample of ``total / parts``)."""
    import numpy as np

    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    cum = np.cumsum(np.asarray(lengths, dtype=np.int64))
    total = int(cum[-1]) if len(cum) else 0
    targets = [total * k / parts for k in range(1, parts)]
    # cut after the sample whose running total is closest to each target
    cuts = []
    for t in targets:
        j = int(np.searchsorted(cum, t))
        if j < len(cum) and j > 0 and abs(cum[j - 1] - t) <= abs(cum[j] - t):
            j -= 1
        cuts.append(min(len(cum), j + 1) if len(cum) else 0)
    bounds = [0] + [max(c, 0) for c in cuts] + [len(cum)]
    for k in range(1, len(bounds)):
        bounds[k] = max(bounds[k], bounds[k - 1])
    return [range(bounds[k], bounds[k + 1]) for k in range(parts)]


def pack_bins(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group indices into bins of at most ``max_tokens`` tokens (best-fit decreasing). Called once
    per rank and mini-batch for every sample of a step on the driver, hence the plain loop with
    local names (no per-sample lambda)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    lens = [int(n) for n in lengths]
    order = sorted(range(len(lens)), key=lens.__getitem__, reverse=True)  # stable: ties in index order
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (room left, bin id)
    find, insert = bisect.bisect_left, bisect.insort
    for i in order:
        n = lens[i]
        k = find(free, (n, -1))
        if n <= max_tokens and k < len(free):
            room, b = free.pop(k)
            bins[b].append(i)
            if room > n:
                insert(free, (room - n, b))
        else:
            bins.append([i])
            if max_tokens > n:
                insert(free, (max_tokens - n, len(bins) - 1))
    return bins


def split_by_token_budget(lengths: Sequence[int], max_tokens: int, max_samples: int = 0) -> list[list[int]]:
    """Padded micro-batches: group indices so each micro-batch's padded size (samples x longest)
    stays within ``max_tokens``. Longest first so similar lengths share a micro-batch; a sample
    longer than the budget gets a micro-batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = max([lengths[j] for j in current] + [lengths[i]])
        too_many = max_samples and len(current) >= max_samples
        if current and (longest * (len(current) + 1) > max_tokens or too_many):
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def split_fixed(num: int, micro_batch_size: int) -> list[list[int]]:
    return [list(range(i, min(i + micro_batch_size, num))) for i in range(0, num, micro_batch_size)]


def equalize(groups: list[list[list[int]]], lengths: Sequence[int], count: int) -> None:
    """Make every rank's list of micro-batches exactly ``count`` long (in place): split the one with
    the most tokens in two (longest-first alternation), or add empty ones when nothing splits."""
    for micro in groups:
        while len(micro) < count:
            splittable = [(sum(lengths[i] for i in mb), j) for j, mb in enumerate(micro) if len(mb) > 1]
            if not splittable:
                micro.append([])
                continue
            _, j = max(splittable)
            halves = balance([lengths[i] for i in micro[j]], 2)
            mb = micro[j]
            micro[j] = [mb[k] for k in halves[0]]
            micro.insert(j + 1, [mb[k] for k in halves[1]])


@dataclass
class ShardPlan:
    """Per data-parallel rank: its samples in execution order, and per mini-batch the size of each
    micro-batch (``0`` = an empty micro-batch). Every rank has the same number of micro-batches in
    every mini-batch."""

    samples: list[list[int]] = field(default_factory=list)
    micro_sizes: list[list[list[int]]] = field(default_factory=list)

    @property
    def dp(self) -> int:
        return len(self.samples)


def plan_shards(lengths: Sequence[int], minibatches: Sequence[Sequence[int]], dp: int, *, packed: bool,
                max_tokens: int, micro_batch_size: int = 1, micro_multiple: int = 1) -> ShardPlan:
    """Data-parallel shards and micro-batches of a pass over ``minibatches`` (lists of sample indices).

    ``packed``: micro-batches of at most ``max_tokens`` tokens laid end to end. Otherwise padded
    micro-batches: ``max_tokens`` (> 0) bounds samples x longest, else ``micro_batch_size`` samples.
    ``micro_multiple``: micro-batch counts are rounded up to a multiple of it (interleaved pipeline
    schedules want a multiple of the pipeline size)."""
    _check_budget(packed, max_tokens)
    plan = ShardPlan([[] for _ in range(dp)], [[] for _ in range(dp)])
    for mb in minibatches:
        mb = list(mb)
        shares = [[mb[k] for k in share] for share in split_contiguous([lengths[i] for i in mb], dp)]
        _add_minibatch(plan, lengths, shares, packed, max_tokens, micro_batch_size, micro_multiple)
    return plan


def _check_budget(packed: bool, max_tokens: int) -> None:
    if packed and max_tokens < 1:
        raise ValueError("packed micro-batches need a token budget (max_tokens >= 1)")


def _add_minibatch(plan: ShardPlan, lengths: Sequence[int], shares: list[list[int]], packed: bool,
                   max_tokens: int, micro_batch_size: int, micro_multiple: int) -> None:
    """Append one mini-batch to ``plan``: rank r's samples ``shares[r]`` cut into micro-batches, the
    same number on every rank (a multiple of ``micro_multiple``)."""
    groups: list[list[list[int]]] = []
    for ids in shares:
        share_lens = [lengths[i] for i in ids]
        if packed:
            local = pack_bins(share_lens, max_tokens)
        elif max_tokens:
            local = split_by_token_budget(share_lens, max_tokens)
        else:
            local = split_fixed(len(ids), micro_batch_size)
        groups.append([[ids[k] for k in g] for g in local])
    count = max(1, max(len(g) for g in groups))
    count = -(-count // micro_multiple) * micro_multiple
    equalize(groups, lengths, count)
    for r, micro in enumerate(groups):
        plan.micro_sizes[r].append([len(m) for m in micro])
        for m in micro:
            plan.samples[r].extend(m)


# ---------------------------------------------------------------------------------------------
# training over the forward pass's ranges: mini-batches stratified per rank
# ---------------------------------------------------------------------------------------------

@dataclass
class StratifiedMinibatches:
    """An epoch's mini-batches drawn per data-parallel rank: rank r owns ``ranges[r]`` (the forward
    pass's contiguous token-balanced range) for the whole epoch, and ``chunks[r][m]`` are its samples
    of mini-batch m. Global mini-batch m is the union of the ranks' m-th chunks, so each rank's
    training shard is its range: a zero-copy view of the batch on the driver instead of a gather of
    samples scattered by a global shuffle. The price: a mini-batch's tokens are balanced over ranks
    only statistically (each rank's chunk is a random draw from its range), not exactly."""

    ranges: list[range]
    chunks: list[list[list[int]]]      # [rank][mini-batch] -> sample indices (shuffled order)

    @property
    def dp(self) -> int:
        return len(self.ranges)

    @property
    def minibatches(self) -> list[list[int]]:
        """Global mini-batches (sample indices), what the loss denominators are computed over."""
        count = len(self.chunks[0]) if self.chunks else 0
        return [[i for rank in self.chunks for i in rank[m]] for m in range(count)]


def minibatch_sizes(num_samples: int, global_batch_size: int) -> list[int]:
    """Samples per mini-batch: ``global_batch_size`` each (at most the batch), a short tail joining
    the last one (the rule of ``trainer.minibatches``)."""
    if num_samples == 0:
        return []
    size = min(max(1, global_batch_size), num_samples)
    sizes = [size] * (num_samples // size)
    sizes[-1] += num_samples % size
    return sizes


def stratified_minibatches(lengths: Sequence[int], dp: int, global_batch_size: int,
                           seed: int) -> StratifiedMinibatches:
    """Mini-batches of an epoch drawn per rank (see :class:`StratifiedMinibatches`).

    The batch is split into ``dp`` contiguous token-balanced ranges (:func:`split_contiguous`, the
    split of a forward pass); each rank shuffles its range with one generator seeded by ``seed``
    (rank 0 first, so at ``dp == 1`` this is :func:`minibatches`: one seeded shuffle of the
    batch cut into mini-batches). Mini-batch m takes the sizes of :func:`minibatch_sizes` exactly;
    its samples come from the ranks in proportion to what each has left (largest remainder), so
    every rank's range is used up by the last mini-batch and every sample is in exactly one."""
    ranges = split_contiguous(lengths, dp)
    gen = torch.Generator().manual_seed(seed)
    shuffled = [[r.start + k for k in torch.randperm(len(r), generator=gen).tolist()] for r in ranges]
    counts = _apportion([len(r) for r in ranges], minibatch_sizes(len(lengths), global_batch_size))
    return StratifiedMinibatches(ranges, [cut(rank, per_mb) for rank, per_mb in zip(shuffled, counts)])


def cut(items: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """``items`` cut into consecutive pieces of ``sizes``."""
    out, start = [], 0
    for n in sizes:
        out.append(list(items[start:start + n]))
        start += n
    return out


def _apportion(have: list[int], sizes: list[int]) -> list[list[int]]:
    """``out[r][m]``: how many of rank r's ``have[r]`` samples go into mini-batch m of ``sizes[m]``
    samples. Each mini-batch is shared out in proportion to what the ranks have left (integer
    largest remainder, ties to the lower rank); the last one takes everything left."""
    left = list(have)
    out: list[list[int]] = [[] for _ in have]
    for m, size in enumerate(sizes):
        total = sum(left)
        if m == len(sizes) - 1 or total == 0:
            take = list(left)
        else:
            take = [size * n // total for n in left]
            rest = sorted(range(len(left)), key=lambda r: (-(size * left[r] % total), r))
            for r in rest[:size - sum(take)]:
                take[r] += 1
        for r, n in enumerate(take):
            out[r].append(n)
            left[r] -= n
    return out


def plan_ranges(lengths: Sequence[int], strat: StratifiedMinibatches, *, packed: bool, max_tokens: int,
                micro_batch_size: int = 1, micro_multiple: int = 1) -> ShardPlan:
    """The :class:`ShardPlan` of a training pass over stratified mini-batches: rank r trains on its
    own chunks only, so its samples are exactly ``strat.ranges[r]``. Micro-batches within a rank's
    chunk follow the rules of :func:`plan_shards` (packing, budgets, equal counts over ranks,
    ``micro_multiple``)."""
    _check_budget(packed, max_tokens)
    if strat.ranges and strat.ranges[-1].stop != len(lengths):
        raise ValueError(f"mini-batches drawn for {strat.ranges[-1].stop} samples, the batch has {len(lengths)}")
    plan = ShardPlan([[] for _ in range(strat.dp)], [[] for _ in range(strat.dp)])
    for m in range(len(strat.chunks[0]) if strat.chunks else 0):
        shares = [strat.chunks[r][m] for r in range(strat.dp)]
        _add_minibatch(plan, lengths, shares, packed, max_tokens, micro_batch_size, micro_multiple)
    return plan


def minibatches(num_samples: int, global_batch_size: int, seed: int) -> list[list[int]]:
    """Shuffled mini-batches of whole samples; a short tail joins the last mini-batch. (The step
    draws them per data-parallel rank, ``WorkerGroup.minibatches``; at dp 1 that is this.)"""
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed)).tolist()
    return cut(order, minibatch_sizes(num_samples, global_batch_size))


def denominators(mask: torch.Tensor, batches: list[list[int]]) -> list[dict[str, float]]:
    """Each mini-batch's loss denominators: the tokens the loss covers and the sequences holding
    any of them (a failed sample, whose mask row is 0, is not a sequence the loss averages over)."""
    return [{"num_tokens": float(mask[b].sum().clamp(min=1)),
             "num_seqs": float((mask[b].sum(-1) > 0).sum().clamp(min=1))} for b in batches]
