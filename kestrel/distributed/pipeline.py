"""Traffic between pipeline stages: each micro-batch's residual stream from a stage to the next, and the logits (and a
model drafter's drafts) from the last stage back to rank 0, by point-to-point sends on the default group (NCCL on
CUDA, gloo on the CPU).

Every rank of a stage sends to the rank of the next stage with its place in the TP group (the stream is the same on
all of them), so the TP groups never gather. A step is cut into micro-batches of whole sequences: stage s works on
micro-batch m + 1 while stage s + 1 works on micro-batch m, which leaves a bubble of (pp - 1) / (M + pp - 1) of
each step's time with M micro-batches.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from .layout import ParallelLayout

LOGITS_TAG = 1 << 20
"""Tags of logits messages start here (stream messages are tagged by their micro-batch)."""
DRAFTS_TAG = 1 << 21
"""The tag of drafts messages."""


class StageLink:
    """This rank's sends to the next stage and receives from the previous one; sends are asynchronous until
    `wait`. `via_host`: device tensors travel through host memory (gloo between ranks sharing a GPU)."""

    def __init__(self, layout: ParallelLayout, via_host: bool = False):
        self.layout = layout
        self.via_host = via_host
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []
        self.bytes_sent: Counter[str] = Counter()

    def send_next(self, x: torch.Tensor, micro_batch: int) -> None:
        """Send micro-batch's stream x [n, T, D] to the next stage."""
        self._send(x, self.layout.stage_rank(self.layout.pp_rank + 1), micro_batch, "stream")

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                  micro_batch: int) -> torch.Tensor:
        """Micro-batch's stream from the previous stage."""
        return self._recv(shape, dtype, device, self.layout.stage_rank(self.layout.pp_rank - 1), micro_batch)

    def send_logits(self, logits: torch.Tensor, micro_batch: int) -> None:
        """The last stage's first TP rank: micro-batch's logits [R, vocab] (fp32) to rank 0."""
        self._send(logits, 0, LOGITS_TAG + micro_batch, "logits")

    def recv_logits(self, rows: int, vocab: int, device: torch.device, micro_batch: int) -> torch.Tensor:
        """Rank 0: micro-batch's logits from the last stage."""
        return self._recv((rows, vocab), torch.float32, device, self.layout.with_rank(0).stage_rank(
            self.layout.pp_size - 1), LOGITS_TAG + micro_batch)

    def send_drafts(self, drafts: list[list[int]], width: int, device: torch.device) -> None:
        """The last stage's first TP rank: a step's drafts (at most width per sequence) to rank 0."""
        table = torch.tensor([draft + [-1] * (width - len(draft)) for draft in drafts], device=device)
        self._send(table, 0, DRAFTS_TAG, "drafts")

    def recv_drafts(self, rows: int, width: int, device: torch.device) -> list[list[int]]:
        """Rank 0: the step's drafts for `rows` sequences, at most width each, from the last stage."""
        table = self._recv((rows, width), torch.long, device,
                           self.layout.with_rank(0).stage_rank(self.layout.pp_size - 1), DRAFTS_TAG)
        return [[t for t in row if t >= 0] for row in table.tolist()]

    def wait(self) -> None:
        """Block until every send has left."""
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()

    def _send(self, x: torch.Tensor, to: int, tag: int, kind: str) -> None:
        x = x.contiguous()
        if self.via_host:
            x = x.cpu()
        self.bytes_sent[kind] += x.nbytes
        self.pending.append((dist.isend(x, to, tag=tag), x))      # x stays alive until its send completes

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, source: int,
              tag: int) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device="cpu" if self.via_host else device)
        dist.recv(x, source, tag=tag)
        return x.to(device)


def micro_batches(lengths: list[int], parts: int) -> list[range]:
    """Cut sequences (their token counts, in order) into at most `parts` contiguous, non-empty runs of nearly equal
    tokens."""
    total, cuts, done = sum(lengths), [0], 0
    for i, n in enumerate(lengths[:-1], 1):
        done += n
        if len(cuts) < parts and done * parts >= total * len(cuts):
            cuts.append(i)
    cuts.append(len(lengths))
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]
