"""Packed micro-batches: shared-prefix segments laid out in rows with block-diagonal attention, no padding per sample.

GRPO samples ``n`` responses per prompt. Trained as ``n`` padded sequences, the prompt is forwarded and
back-propagated ``n`` times: in the quick-start ~80% of the trainer's tokens repeat a prompt. A *segment* here is
one prompt followed by every response of the micro-batch that shares it (or a single sample's whole sequence)::

    tokens     [p0 p1 p2 | a0 a1 a2 | b0 b1 ]      one segment: prompt p, responses a and b
    positions  [ 0  1  2 |  3  4  5 |  3  4 ]      each response continues the prompt's positions
    attends    prompt: causal; a_j: p and a_0..a_j; b_j: p and b_0..b_j (never the other response)

The prompt's last position predicts the first token of every response; each response token predicts the next.
Segments go into rows of at most ``max_row_tokens`` (a longer segment gets a row of its own), segment after segment,
position ids restarting per segment, attention blocked between segments; rows are padded only at their ends, and a
pad token attends to itself alone (an all-masked softmax row would be NaN). Every response token sees exactly the
keys it saw in its own padded sequence at the same positions, so logprobs, losses and gradients equal the padded
computation up to float summation order, while the prompt's activations and gradient are computed once.

``plan_micro_batches`` cuts a shard into micro-batches of segments by sample count and token budget (a segment
over a bound is cut into pieces, each with its prompt).

Usage::

    packed = pack_rows(batch, share_prefix=True, max_row_tokens=512)
    out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=packed.attention)
    logits_of_targets = out.logits.reshape(-1, vocab)[packed.source[packed.source >= 0]]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import Field

from miles_ray.config import StrictConfig
from miles_ray.types import RolloutBatch


class PackingConfig(StrictConfig):
    """How a backend lays micro-batches out: packed rows of shared-prefix segments (see the module docstring)."""

    share_prefix: bool = Field(
        True, description="Samples with the same prompt tokens share one forward and backward of the prompt."
    )
    max_row_tokens: int | None = Field(
        None,
        ge=1,
        le=1_048_576,
        description="Put several segments in a row, up to this many tokens (a longer segment gets a row of its own); "
        "None: one segment per row, rows padded to the longest. Attention is dense per row, so its cost grows with "
        "the row length; more rows pad more.",
    )


class MicroBatchConfig(StrictConfig):
    """How a backend cuts a rank's shard into micro-batches and lays them out (both backends' configs extend it)."""

    micro_batch_size: int = Field(
        8, ge=1, le=4096, description="Samples per forward/backward on one data-parallel rank at most."
    )
    max_tokens_per_micro_batch: int | None = Field(
        None, ge=1, description="Packed tokens per forward/backward at most, besides micro_batch_size; None: no bound."
    )
    packing: PackingConfig | None = Field(
        default_factory=PackingConfig,
        description="Packed rows with shared prompts (backends.packing); None: one padded row per sample.",
    )


@dataclass(frozen=True)
class Segment:
    """Samples (batch rows) that share a prompt of ``prompt_len`` tokens; one sample: its whole sequence."""

    samples: tuple[int, ...]
    prompt_len: int
    num_tokens: int  # prompt once plus every response


@dataclass(frozen=True)
class PackedBatch:
    """A micro-batch laid out as packed rows.

    Attributes:
        input_ids: ``[R, L]`` tokens, 0 past each row's end.
        position_ids: ``[R, L]``.
        attention: ``[R, 1, L, L]`` bool, True where query ``i`` may attend key ``j``.
        source: ``[B, T-1]`` flat index (``row * L + col``) of the position whose output predicts token ``t+1`` of
            sample ``b`` (the ``[B, T-1]`` logprob alignment), for every response token; -1 elsewhere.
        routes: ``[R, L, num_layers, top_k]`` the batch's MoE routes in the packed layout (-1 where none), or None.
        num_tokens: real (non-pad) tokens in the rows.

    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention: torch.Tensor
    source: torch.Tensor
    routes: torch.Tensor | None
    num_tokens: int

    def columns(self) -> torch.Tensor:
        """The sorted columns any row needs outputs at (a model may compute its LM head only there)."""
        width = self.input_ids.shape[1]
        return torch.unique(self.source[self.source >= 0] % width)

    def needed(self, outputs: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
        """The outputs that predict each trained token: ``[N, ...]`` in the order of ``source >= 0``.

        ``outputs`` is ``[R, K, ...]`` at ``columns`` (``columns()``, as an LM head restricted to them gives), or
        ``[R, L, ...]`` at every column.
        """
        width = self.input_ids.shape[1]
        flat = self.source[self.source >= 0].to(outputs.device)
        rows, cols = flat // width, flat % width
        if columns is not None:  # column c of the row is output k where columns[k] == c
            lookup = torch.full((width,), -1, dtype=torch.long, device=outputs.device)
            lookup[columns.to(outputs.device)] = torch.arange(len(columns), device=outputs.device)
            cols = lookup[cols]
        return outputs[rows, cols]

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """``[B, T-1]``: ``values`` (``[N]``, in ``needed`` order) at the trained positions, 0 elsewhere."""
        out = values.new_zeros(self.source.shape)
        out[self.source.to(values.device) >= 0] = values
        return out


def segments(batch: RolloutBatch, share_prefix: bool) -> list[Segment]:
    """The batch's samples as segments, in order of first appearance: samples with the same prompt tokens share one.

    Raises:
        ValueError: if the batch carries no ``prompt_lengths`` (build it with ``RolloutBatch.from_samples``).

    """
    if batch.prompt_lengths is None:
        raise ValueError("packing needs RolloutBatch.prompt_lengths (RolloutBatch.from_samples sets them)")
    lengths = batch.attention_mask.sum(dim=1).tolist()
    prompt_lengths = batch.prompt_lengths.tolist()
    groups: dict[tuple, list[int]] = {}
    for b in range(batch.num_samples):
        key = tuple(batch.input_ids[b, : prompt_lengths[b]].tolist()) if share_prefix else (b,)
        groups.setdefault(key, []).append(b)
    out = []
    for members in groups.values():
        p = prompt_lengths[members[0]]
        out.append(Segment(tuple(members), p, p + sum(lengths[b] - p for b in members)))
    return out


def plan_micro_batches(
    batch: RolloutBatch, max_samples: int, max_tokens: int | None = None, share_prefix: bool = True
) -> list[torch.Tensor]:
    """Micro-batches of segments, in order: at most ``max_samples`` samples and ``max_tokens`` packed tokens.

    A segment over either bound is cut into pieces within them, each with the prompt once (its prompt is then
    forwarded once per piece: the bounds are what keeps a micro-batch in memory). A single sample over
    ``max_tokens`` is a micro-batch of its own.

    Returns:
        One ``LongTensor`` of batch rows per micro-batch.

    """
    segs = segments(batch, share_prefix) if batch.prompt_lengths is not None else _singles(batch)
    lengths = batch.attention_mask.sum(dim=1).tolist()
    plans: list[list[int]] = []
    samples = tokens = 0
    for seg in (piece for s in segs for piece in _pieces(s, lengths, max_samples, max_tokens)):
        full = samples + len(seg.samples) > max_samples or (
            max_tokens is not None and tokens + seg.num_tokens > max_tokens
        )
        if not plans or (full and samples):
            plans.append([])
            samples = tokens = 0
        plans[-1].extend(seg.samples)
        samples += len(seg.samples)
        tokens += seg.num_tokens
    return [torch.tensor(rows, dtype=torch.long) for rows in plans]


def _pieces(seg: Segment, lengths: list[int], max_samples: int, max_tokens: int | None) -> list[Segment]:
    """``seg`` cut into segments of at most ``max_samples`` samples and ``max_tokens`` tokens, each with the prompt."""
    pieces, members, tokens = [], [], seg.prompt_len
    for b in seg.samples:
        response = lengths[b] - seg.prompt_len
        if members and (len(members) == max_samples or (max_tokens is not None and tokens + response > max_tokens)):
            pieces.append(Segment(tuple(members), seg.prompt_len, tokens))
            members, tokens = [], seg.prompt_len
        members.append(b)
        tokens += response
    pieces.append(Segment(tuple(members), seg.prompt_len, tokens))
    return pieces


def micro_batches_of(batch: RolloutBatch, config: MicroBatchConfig) -> list[torch.Tensor]:
    """``plan_micro_batches`` by a backend config's micro_batch_size, max_tokens_per_micro_batch and packing."""
    share = config.packing is not None and config.packing.share_prefix
    return plan_micro_batches(batch, config.micro_batch_size, config.max_tokens_per_micro_batch, share)


def pack_rows(batch: RolloutBatch, share_prefix: bool = True, max_row_tokens: int | None = None) -> PackedBatch:
    """Lay ``batch`` out as packed rows (see the module docstring); ``max_row_tokens`` None: a segment per row."""
    segs = segments(batch, share_prefix)
    rows = _rows(segs, max_row_tokens)
    width = max(sum(s.num_tokens for s in row) for row in rows)
    num_rows = len(rows)
    input_ids = torch.zeros(num_rows, width, dtype=torch.long)
    position_ids = torch.zeros(num_rows, width, dtype=torch.long)
    segment_of = torch.full((num_rows, width), -1, dtype=torch.long)  # -1: padding
    owner = torch.full((num_rows, width), -1, dtype=torch.long)  # the sample a response token belongs to; -1: prompt
    source = torch.full((batch.num_samples, batch.input_ids.shape[1] - 1), -1, dtype=torch.long)
    origin = []  # (row, col, sample, position in the sample's own sequence) of every packed token
    for r, row in enumerate(rows):
        col = 0
        for k, seg in enumerate(row):
            col = _place(batch, seg, r, col, k, width, (input_ids, position_ids, segment_of, owner), source, origin)
    attention = _attention(segment_of, owner)
    return PackedBatch(
        input_ids, position_ids, attention, source, _packed_routes(batch, origin, rows, width), len(origin)
    )


def _singles(batch: RolloutBatch) -> list[Segment]:
    lengths = batch.attention_mask.sum(dim=1).tolist()
    return [Segment((b,), 0, int(n)) for b, n in enumerate(lengths)]


def _rows(segs: list[Segment], max_row_tokens: int | None) -> list[list[Segment]]:
    """Segments in order into rows of at most ``max_row_tokens`` (a longer segment alone); None: one per row."""
    rows: list[list[Segment]] = []
    used = 0
    for seg in segs:
        if not rows or max_row_tokens is None or used + seg.num_tokens > max_row_tokens:
            rows.append([])
            used = 0
        rows[-1].append(seg)
        used += seg.num_tokens
    return rows


def _place(batch, seg: Segment, r: int, col: int, k: int, width: int, grids, source, origin) -> int:
    """Write segment ``k`` of row ``r`` from column ``col`` and ``source`` for its samples; the next column."""
    input_ids, position_ids, segment_of, owner = grids
    p = seg.prompt_len
    first = seg.samples[0]
    input_ids[r, col : col + p] = batch.input_ids[first, :p]
    position_ids[r, col : col + p] = torch.arange(p)
    segment_of[r, col : col + p] = k
    origin += [(r, col + t, first, t) for t in range(p)]
    prompt_end = col + p - 1  # its output predicts every response's first token
    col += p
    for b in seg.samples:
        n = int(batch.attention_mask[b].sum()) - p
        input_ids[r, col : col + n] = batch.input_ids[b, p : p + n]
        position_ids[r, col : col + n] = torch.arange(p, p + n)
        segment_of[r, col : col + n] = k
        owner[r, col : col + n] = b
        origin += [(r, col + j, b, p + j) for j in range(n)]
        if n:  # logprob position t predicts token t+1: p-1 the first response token, p+j the one after token p+j
            source[b, p - 1] = r * width + prompt_end
            source[b, p : p + n - 1] = r * width + torch.arange(col, col + n - 1)
        col += n
    return col


def _attention(segment_of: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """``[R, 1, L, L]``: causal within a segment; a response token sees the prompt and its own response only."""
    width = segment_of.shape[1]
    same_segment = (segment_of[:, :, None] == segment_of[:, None, :]) & (segment_of[:, :, None] >= 0)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    visible = (owner[:, None, :] == -1) | (owner[:, None, :] == owner[:, :, None])  # key is prompt, or own response
    allowed = same_segment & causal & visible
    allowed |= torch.eye(width, dtype=torch.bool)  # padding attends to itself (an all-masked row would be NaN)
    return allowed[:, None]


def _packed_routes(batch: RolloutBatch, origin: list, rows: list, width: int) -> torch.Tensor | None:
    """The batch's MoE routes moved to the packed positions (a shared prompt takes its first sample's)."""
    if batch.routes is None:
        return None
    routes = torch.full((len(rows), width, *batch.routes.shape[2:]), -1, dtype=batch.routes.dtype)
    index = torch.tensor(origin, dtype=torch.long)
    routes[index[:, 0], index[:, 1]] = batch.routes[index[:, 2], index[:, 3]]
    return routes
