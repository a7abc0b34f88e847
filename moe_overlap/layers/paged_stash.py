"""The device-planned MoE exchange's backward stash in pages (``overlap.moe_paged_stash_factor``).

A device-planned layer call sizes each chunk's tensors for its bound (``overlap.moe_expert_rank_capacity_factor``, or
the worst case), and the backward needs two of them (the chunk's grouped rows and their fc1 output; with each token
once per rank also the expert outputs). Kept as they are, every layer call in flight holds them at the bound, and a
graphed layer holds them in its graph's pool. Paged, each chunk's tensors are copied after its GEMMs into one pool
of pages per rank that every MoE layer call in flight shares, as many pages as the rows it actually received take
(a count on the device), and copied back into fresh tensors by the backward, which returns the pages. So between
forward and backward a call holds the rows it received, not its bound: the bounded tensors live only within the
call (a graph's pool reuses them for the next layer), and the slack is pooled, so a layer that receives more than
its share takes pages another left.

The pool holds ``factor`` x the balanced rows (T x k a call) of every layer call in flight, plus a page per stash
for its last, partly used page. A chunk whose rows do not fit in the free pages takes none: its rows are counted as
overflow rows (the exchange's counter: the step is skipped on the device and run again planned on the host, as past
the receive bound) and written to the spare page. Everything is a device tensor (the free pages are a stack on the
device), so nothing syncs with the host and graphed layers replay it; the trainer resets the stack before each step.
The rows move with the exchange's row kernels (kernels/push_rows.py): only the counted rows, at HBM speed.

One pooled row holds a stash's tensors side by side as bytes (``row_bytes``, each at a 16-byte column), FP8 rows as
their bytes and scale. Rows past the count of a tensor taken back are left unwritten (a poison of 0xFF bytes in the
torch twin: NaN in every float type), as nothing reads them: the grouped GEMMs, SwiGLU and the weight gradients stop
at the offsets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from moe_overlap.kernels.launch import use_triton
from moe_overlap.kernels.push_rows import push_rows, repeat_rows
from moe_overlap.layers.fp8 import Fp8Rows

PAGE_ROWS = 128  # rows a page holds at most: a stash's last page is partly used, so the pool keeps one per stash
_ALIGN = 16  # bytes: each tensor's columns start on a 16-byte boundary of the pooled row (vector loads)

Stashable = torch.Tensor | Fp8Rows | None


def page_rows_for(chunk_rows: int) -> int:
    """Rows a page holds for chunks of ``chunk_rows`` balanced rows: PAGE_ROWS, or for small chunks the power of two
    at most an eighth of them (so that the partly used last pages stay a small part of the pool)."""
    return max(1, min(PAGE_ROWS, 1 << max(0, (chunk_rows // 8).bit_length() - 1)))


def stash_pages(rows: int, stashes: int, page_rows: int = PAGE_ROWS) -> int:
    """Pages of a pool for ``rows`` stashed rows in ``stashes`` stashes (each may leave its last page partly used)."""
    return -(-rows // page_rows) + stashes


def aligned_bytes(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass
class Stashed:
    """One stash in the pool: where its rows went and how to rebuild its tensors."""

    table_M: torch.Tensor  # int64: the page of each run of page_rows rows (the spare page past the pages taken)
    taken: torch.Tensor  # int64 scalar: pages taken from the stack (0: the rows did not fit)
    rows: torch.Tensor  # one-element int: the rows kept (the chunk's grouped rows)
    layout: list[tuple]  # per tensor: None, or (kind, shape, dtype, column, width in bytes)


def _bytes_2d(t: torch.Tensor) -> torch.Tensor:
    """``t``'s rows as bytes, (rows, bytes), the same memory (rows contiguous along their columns)."""
    rows = t.shape[0]
    flat = t.reshape(rows, -1) if t.dim() != 2 else t
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


class PagedStash:
    """The pool of one rank: ``rows`` pooled rows of ``row_bytes`` in pages, for ``stashes`` stashes at most in
    flight (layer calls x chunks x token slices); ``count_overflow`` adds a stash's rows that do not fit (the
    exchange's overflow counter)."""

    def __init__(self, rows: int, stashes: int, row_bytes: int, device: torch.device,
                 count_overflow: Callable[[torch.Tensor], None], page_rows: int = PAGE_ROWS):
        self.page_rows, self.row_bytes = page_rows, aligned_bytes(row_bytes)
        self.pages = stash_pages(rows, stashes, page_rows)
        self.spare = self.pages  # the page past the pool: rows that fit nowhere land there
        self.count_overflow = count_overflow
        # the pool and its spare page, one row of bytes per stashed row
        self.rows_NB = torch.empty(((self.pages + 1) * page_rows, self.row_bytes), dtype=torch.uint8, device=device)
        # the stack of free pages: free_P[:top]; twice the pages, so that a stash's whole table can be written
        # back at top (entries past the pages it took land past the stack, where nothing reads them)
        self.free_P = torch.zeros(2 * self.pages, dtype=torch.int64, device=device)
        self.top = torch.zeros((), dtype=torch.int64, device=device)
        # made at the first stash (eager: a graph's warm-up), so that a capture replays them
        self._ranges: dict[int, torch.Tensor] = {}
        self._bases: dict[int, torch.Tensor] = {}  # a column's address in the pool
        self._ranks: dict[int, torch.Tensor] = {}  # zeros: every row's destination is the pool
        self._zero = torch.zeros(1, dtype=torch.int64, device=device)
        self.reset()

    @property
    def nbytes(self) -> int:
        return self.rows_NB.numel()

    def reset(self) -> None:
        """Every page free (before a step: a step whose backward did not run leaves none taken)."""
        self.free_P[:self.pages].copy_(self._range(self.pages))
        self.top.fill_(self.pages)

    def free_pages(self) -> torch.Tensor:
        return self.top.clone()

    def _range(self, n: int) -> torch.Tensor:
        if n not in self._ranges:
            self._ranges[n] = torch.arange(n, device=self.top.device)
        return self._ranges[n]

    def _pooled_rows(self, table_M: torch.Tensor, rows: int) -> torch.Tensor:
        """The pooled row of each of a stash's ``rows`` rows."""
        r = self._range(rows)
        return table_M[r // self.page_rows] * self.page_rows + r % self.page_rows

    def put(self, tensors: list[Stashable], rows: torch.Tensor) -> Stashed:
        """Copy the first ``rows`` (a one-element device tensor) rows of each tensor (every one of the same rows,
        at least that many) into pages taken from the stack."""
        bound = max(t.shape[0] for t in tensors if t is not None)
        parts, layout, column = [], [], 0
        for t in tensors:
            if t is None:
                layout.append(None)
                continue
            for kind, part in (("fp8", t.q_RK), ("scale", t.scales)) if isinstance(t, Fp8Rows) else (("plain", t),):
                bytes_RB = _bytes_2d(part)
                layout.append((kind, tuple(part.shape), part.dtype, column, bytes_RB.shape[1],
                               t.dtype if kind == "fp8" else None))
                parts.append((bytes_RB, column))
                column += aligned_bytes(bytes_RB.shape[1])
        if column > self.row_bytes:
            raise ValueError(f"a stash of {column} bytes a row does not fit the pool's rows of {self.row_bytes}")
        pages = -(-bound // self.page_rows)
        need = (rows.reshape(()).long() + self.page_rows - 1) // self.page_rows
        fits = need <= self.top
        taken = need * fits
        j = self._range(pages)
        index = (self.top - taken + j).clamp(0, self.free_P.numel() - 1)
        table_M = torch.where(j < taken, self.free_P[index], self.spare)
        self.top.sub_(taken)
        self.count_overflow(torch.where(fits, 0, rows.reshape(()).long()))
        pooled_R = self._pooled_rows(table_M, bound)
        for bytes_RB, column in parts:
            self._write(bytes_RB, rows, pooled_R, column)
        return Stashed(table_M, taken, rows, layout)

    def take(self, stashed: Stashed) -> list[Stashable]:
        """The stash's tensors back (fresh, their rows past the count unwritten), its pages back on the stack."""
        bound = next(entry[1][0] for entry in stashed.layout if entry is not None)
        pooled_R = self._pooled_rows(stashed.table_M, bound)
        out, entries = [], iter(stashed.layout)
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            tensor = self._read(entry, stashed.rows, pooled_R)
            if entry[0] == "fp8":  # its scales follow it
                out.append(Fp8Rows(tensor, self._read(next(entries), stashed.rows, pooled_R), entry[5]))
            else:
                out.append(tensor)
        back = min(stashed.table_M.numel(), self.pages)  # a stash takes no more than the pool's pages
        self.free_P.index_copy_(0, self.top + self._range(back), stashed.table_M[:back])
        self.top.add_(stashed.taken)
        return out

    def _write(self, bytes_RB: torch.Tensor, rows: torch.Tensor, pooled_R: torch.Tensor, column: int) -> None:
        width = bytes_RB.shape[1]
        if use_triton(bytes_RB, "paged stash"):
            if column not in self._bases:
                self._bases[column] = torch.tensor([self.rows_NB.data_ptr() + column], device=self.top.device)
            if pooled_R.shape[0] not in self._ranks:  # one destination: the pool
                self._ranks[pooled_R.shape[0]] = torch.zeros_like(pooled_R, dtype=torch.int32)
            push_rows(bytes_RB, self._zero, rows, self._ranks[pooled_R.shape[0]], pooled_R, self._zero,
                      self._bases[column], dst_row_stride=self.row_bytes)
        else:  # the twin: the count read on the host
            n = int(rows.reshape(-1)[0])
            self.rows_NB[pooled_R[:n], column:column + width] = bytes_RB[:n]

    def _read(self, entry: tuple, rows: torch.Tensor, pooled_R: torch.Tensor) -> torch.Tensor:
        _, shape, dtype, column, width, _ = entry
        out = torch.empty(shape, dtype=dtype, device=self.rows_NB.device)
        bytes_RB = _bytes_2d(out)
        source = self.rows_NB[:, column:column + width]
        if use_triton(bytes_RB, "paged stash"):
            repeat_rows(bytes_RB[:, :0], self._zero, rows, bytes_RB, self._zero, rows, gather=(source, pooled_R))
        else:  # the twin: rows past the count poisoned (NaN in every float type), as nothing may read them
            n = int(rows.reshape(-1)[0])
            bytes_RB[:n] = source[pooled_R[:n]]
            bytes_RB[n:] = 255
        return out
