"""Where the MoE exchange's rows go: the host-planned layout and routes (sizes read on the host, exact buffers)
and the device-planned routes (every size a device tensor, static buffers: bounded, layers/device_plan.py). The planners
(layers/host_plan.py, layers/device_plan.py) build them; the transports (a2a_host.py, a2a_push.py) follow them.

Rows travel in chunks of local experts; a rank's permuted rows are ordered (chunk, destination rank, local
expert), and a chunk's received rows are handed to the grouped GEMMs in (local expert, source rank) order.
Letters: S source rank, D destination rank, C chunk, A any rank, P a rank's peer; R a permuted buffer's rows, W
the compact receive buffer's rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class ExchangeLayout:
    """Rows per (chunk, peer) and their first row on each side; all lists are [chunk][peer]."""

    send_rows: list[list[int]]
    send_offsets: list[list[int]]  # in this rank's send buffer
    recv_rows: list[list[int]]
    recv_offsets: list[list[int]]  # in this rank's receive buffer
    remote_recv_offsets: list[list[int]]  # where this rank's rows land in each peer's receive buffer
    remote_send_offsets: list[list[int]]  # where each peer's rows for this rank sit in its send buffer
    send_total: int
    recv_total: int

    def send_range(self, chunk: int) -> tuple[int, int]:
        return self.send_offsets[chunk][0], self.send_offsets[chunk][0] + sum(self.send_rows[chunk])

    def recv_range(self, chunk: int) -> tuple[int, int]:
        return self.recv_offsets[chunk][0], self.recv_offsets[chunk][0] + sum(self.recv_rows[chunk])

    def remote_rows(self, rank: int) -> tuple[int, int]:
        """The rows this rank (``rank``, its index among the peers) sends to other ranks: to the experts, and back."""
        return (self.send_total - sum(rows[rank] for rows in self.send_rows),
                self.recv_total - sum(rows[rank] for rows in self.recv_rows))

    def reversed(self) -> ExchangeLayout:
        """The same rows travelling back (combine after dispatch, or the gradients of either)."""
        return ExchangeLayout(self.recv_rows, self.recv_offsets, self.send_rows, self.send_offsets,
                              self.remote_send_offsets, self.remote_recv_offsets, self.recv_total, self.send_total)


def exchange_layout(rows_SDC: np.ndarray, rank: int) -> ExchangeLayout:
    """Layout of a chunked exchange from ``rows_SDC[source, destination, chunk]`` (every rank's counts).

    Host work on every layer call, so numpy on a few dozen integers rather than torch ops.
    """
    rows_SDC = np.asarray(rows_SDC, dtype=np.int64)
    peers, chunks = rows_SDC.shape[1], rows_SDC.shape[2]

    def exclusive_offsets(rows_ACP: np.ndarray) -> np.ndarray:  # for each rank A: chunk-major, peers inside a chunk
        flat = rows_ACP.reshape(peers, chunks * peers)
        return (np.cumsum(flat, axis=1) - flat).reshape(peers, chunks, peers)

    send_offsets_SCD = exclusive_offsets(rows_SDC.transpose(0, 2, 1))  # [source, chunk, destination]
    recv_offsets_DCS = exclusive_offsets(rows_SDC.transpose(1, 2, 0))  # [destination, chunk, source]
    return ExchangeLayout(
        send_rows=rows_SDC[rank].T.tolist(),
        send_offsets=send_offsets_SCD[rank].tolist(),
        recv_rows=rows_SDC[:, rank].T.tolist(),
        recv_offsets=recv_offsets_DCS[rank].tolist(),
        remote_recv_offsets=recv_offsets_DCS[:, :, rank].T.tolist(),  # [chunk, destination]
        remote_send_offsets=send_offsets_SCD[:, :, rank].T.tolist(),  # [chunk, source]
        send_total=int(rows_SDC[rank].sum()),
        recv_total=int(rows_SDC[:, rank].sum()),
    )


@dataclass
class HostRoutes:
    """Host-planned: the layout, and per chunk the gather from arrival order (source, local expert) to the
    grouped order (local expert, source) and back; None where the rows arrive in the order they are taken (wire
    rows in slots: one target per chunk, layers/device_plan.py)."""

    layout: ExchangeLayout
    regroup: list[torch.Tensor] | None
    ungroup: list[torch.Tensor] | None

    def remote_rows(self, rank: int) -> tuple[int, int]:
        return self.layout.remote_rows(rank)


@dataclass
class DeviceRoutes:
    """Device-planned, every size a device tensor; buffers have static shapes (their bound: layers/device_plan.py).

    This rank's permuted rows of chunk c are rows [send_start_C[c], + send_rows_C[c]); permuted row r goes to
    rank dst_rank_R[r], row dst_row_R[r] of its compact receive buffer (chunks in order, each in grouped
    order). This rank's received rows of chunk c are compact rows [recv_start_C[c], + recv_rows_C[c]), copied
    out to row 0 of a ``chunk_rows[c]``-row tensor; compact row q goes back to rank back_rank_W[q], row
    back_row_W[q] of its ``send_rows``-row permuted buffer."""

    send_start_C: torch.Tensor
    send_rows_C: torch.Tensor
    dst_rank_R: torch.Tensor
    dst_row_R: torch.Tensor
    recv_start_C: torch.Tensor
    recv_rows_C: torch.Tensor
    back_rank_W: torch.Tensor
    back_row_W: torch.Tensor
    send_rows: int  # static rows of a permuted buffer
    recv_rows: int  # static rows of the compact receive buffer, the spare row for rows past the bound last
    chunk_rows: list[int]  # static rows of each chunk's grouped tensor
    _remote: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def remote_rows(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows this rank (``rank``, its index among the peers) sends to other ranks, on the device: its permuted
        rows to the experts (those past a bound too, which land in the spare row), and the received rows that fit
        back. Made once per layer call; the four exchanges of a call (and its backward) share them."""
        if self._remote is None:
            self._remote = (_remote(self.send_start_C, self.send_rows_C, self.dst_rank_R, rank),
                            _remote(self.recv_start_C, self.recv_rows_C, self.back_rank_W, rank))
        return self._remote


def _remote(start_C: torch.Tensor, rows_C: torch.Tensor, rank_R: torch.Tensor, me: int) -> torch.Tensor:
    """Rows within the chunks' ranges [start, start + rows) whose rank is not ``me``."""
    r = torch.arange(rank_R.shape[0], device=rank_R.device)
    inside_R = ((r >= start_C[:, None]) & (r < (start_C + rows_C)[:, None])).any(0)
    return (inside_R & (rank_R != me)).sum()
