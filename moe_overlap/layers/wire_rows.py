"""Each token once per destination (``overlap.moe_dispatch_once_per_rank``): the rows that cross the wire.

Without it every kept (token, expert) copy is its own row on the wire, so a token whose k experts share a rank
crosses to it several times. With it the exchange moves *wire rows*, one per (token, chunk, destination rank) that
holds any of the token's experts, ordered (chunk, destination rank, token) like the copy rows; the transports and
their routes are unchanged (they move rows and do not care what a row means), and two local steps bracket them:

  token side      x_TH --row_TC--> wire rows   (C: a token's distinct targets, at most min(K, chunks x EP)); the
                  SM push reads each wire row from its token's row as it moves it (:func:`token_rows`,
                  GatheredRows), other transports take them permuted into a send buffer; dispatch backward sums
                  a token's wire rows' gradients (permute_backward); combine sums the rows that came back
                  (permute_backward); its backward sends the output gradient's rows the same way as the dispatch
  expert side     wire rows --permute(expert_row_WJ)--> the chunk's grouped rows (J: the row's copies, at most
                  min(K, a chunk's local experts)); combine weights each expert output by its routing prob and
                  sums a wire row's copies (unpermute) before the one row goes back; its backward gives the
                  outputs' gradients and the probs' gradients on the expert side (unpermute_backward); the dgrad
                  rows of a wire row's copies are summed before they go back (permute_backward)

The expert side learns each wire row's copies from the sender: beside the hidden state, a dispatched row carries
J int32 grouped rows (chunk-relative, in the receiver's (local expert, source rank) order; stored plus one, 0: no
copy, so that no byte pattern written is a NaN read as a float: a compute-only reference reads a region's leftovers
of an exchange of another width) and J fp32 probs, as raw bits in extra columns of the row (the transports move
bytes unchanged: bit-exact; padded to 16 bytes). The probs'
gradients travel back the same way, J fp32 in extra columns of the dgrad rows, and are scattered into
grad_probs_TK on the token side (so the probs' gradient comes out of the dispatch's backward, not the combine's).
A token's k experts are distinct (top-k), so a wire row holds at most J copies.

With ``overlap.moe_dispatch_dtype=fp8`` (DeepSeek-V3's dispatch) the hidden part of a dispatched row, and of an
output-gradient row in the combine's backward, crosses as E4M3 bytes with one float32 scale (kernels/fp8_quant.py,
quantized per token once, whatever its wire rows), as raw bits in the row's columns: about half the bytes. The
receiver dequantizes them on arrival (:func:`hidden_states`), so the experts compute on exactly the dequantized
rows; under ``train.fp8_recipe`` the dispatched rows instead reach the experts' first GEMM as they crossed, E4M3
bytes and scales expanded to the copies' rows (:func:`copies_rows`), with no second quantization (the output
gradient's rows are still dequantized: the probs' gradient reads them). The combine and the dispatch's backward
stay in the activations' dtype.

Letters: T tokens, K copies per token, C a token's wire rows, V targets (rank x chunks + chunk, the order every
rank's counts are gathered in), W wire rows, J a wire row's copies, M the extra columns, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_overlap.distributed.a2a_exchange import GatheredRows
from moe_overlap.kernels.copy_rows import copy_rows
from moe_overlap.kernels.fp8_quant import FP8, dequantize_rows, quantize_rows
from moe_overlap.kernels.permute import permute, permute_backward
from moe_overlap.kernels.wire_targets import copy_grads, distinct_targets, pack_copies, unpack_copies, wire_copies
from moe_overlap.layers.fp8 import Fp8Rows

WORD = 4  # bytes of one int32 grouped row or fp32 prob in a row's extra columns
ALIGN_WORDS = 4  # the extra columns padded to 16 bytes: a row of 16-byte aligned hidden stays so (vector stores)


def copies_per_wire_row(topk: int, chunk_experts: list[tuple[int, int]]) -> int:
    """J: the most copies one wire row can carry (a token's distinct experts within one chunk of one rank)."""
    return min(topk, max(stop - start for start, stop in chunk_experts))


def _padded_words(words: int) -> int:
    return -(-words // ALIGN_WORDS) * ALIGN_WORDS


def extra_columns(words: int, dtype: torch.dtype) -> int:
    """Columns of ``dtype`` that hold ``words`` int32 / fp32 values, padded to 16 bytes."""
    size = torch.empty((), dtype=dtype).element_size()
    if WORD % size:
        raise ValueError(f"moe_dispatch_once_per_rank: rows of {dtype} cannot carry 4-byte values")
    return _padded_words(words) * WORD // size


def wire_row_bytes(hidden_bytes: int, copies: int) -> int:
    """The widest row that crosses: a dispatched one, its hidden state and 2 x J words (padded)."""
    return hidden_bytes + _padded_words(2 * copies) * WORD


def hidden_columns(hidden: int, dtype: torch.dtype, fp8: bool) -> int:
    """Columns of ``dtype`` the hidden part of a row takes: ``hidden``, or with ``fp8`` its bytes and one
    float32 scale, padded to 16 bytes (so that whole rows stay 16-byte aligned: the pushes' vector stores)."""
    if not fp8:
        return hidden
    return _padded_words(hidden // WORD + 1) * WORD // torch.empty((), dtype=dtype).element_size()


def packed_hidden(x_TH: torch.Tensor, fp8: bool) -> torch.Tensor:
    """The hidden part of the rows that cross: x as it is, or with ``fp8`` each row's E4M3 bytes and float32
    scale as raw bits in x's dtype (no gradient flows through it: the backward sends its own rows)."""
    if not fp8:
        return x_TH
    T, H = x_TH.shape
    packed_TX = x_TH.new_empty((T, hidden_columns(H, x_TH.dtype, True)))
    q_TH, scale_T = _packed_parts(packed_TX, H)
    quantize_rows(x_TH.detach(), q_TH, scale_T)  # one pass, straight into the packed rows
    return packed_TX


def _packed_parts(rows_RX: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of packed rows' E4M3 bytes (R, hidden) and float32 scales (R,) (rows may be strided)."""
    bytes_RB = rows_RX.view(torch.uint8)
    return bytes_RB[:, :hidden].view(FP8), bytes_RB[:, hidden:hidden + WORD].view(torch.float32)[:, 0]


def hidden_states(rows_WX: torch.Tensor, hidden: int, fp8: bool, count: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """The hidden states of received rows (a view), or with ``fp8`` dequantized from their bytes and scale into
    the rows' dtype: the rows below ``count`` (on the device; None: all), the others left unwritten (rows past the
    count were never received: no copy of theirs is read; a worst-case buffer's tail costs no pass)."""
    if not fp8:
        return rows_WX[:, :hidden]
    q_WH, scale_W = _packed_parts(rows_WX[:, :hidden_columns(hidden, rows_WX.dtype, True)], hidden)
    return dequantize_rows(q_WH, scale_W, rows_WX.dtype, None if count is None else count.reshape(1))


def _words(values_RW: torch.Tensor) -> torch.Tensor:
    """int32 / fp32 columns as raw int32 words, zero padded to 16 bytes (every byte written: no stale NaN)."""
    words_RW = values_RW.view(torch.int32)
    pad = _padded_words(words_RW.shape[1]) - words_RW.shape[1]
    return torch.nn.functional.pad(words_RW, (0, pad)) if pad else words_RW


@dataclass
class WireRows:
    """One layer call's wire rows on the token side (no counts needed: built before any exchange)."""

    row_TC: torch.Tensor  # int32 wire row of each of a token's distinct targets; -1 pads
    token_of_row_R: torch.Tensor  # int32 the token of each wire row (0 past them: never sent)
    row_of_copy_TK: torch.Tensor  # int64 wire row carrying each copy; num_rows (a spare) if dropped
    slot_TK: torch.Tensor  # int64 the copy's place among its wire row's J
    counts_V: torch.Tensor  # int64 this rank's wire rows per target (rank x chunks + chunk)
    num_rows: int  # static rows of the send buffer, T x C (in slots: T x V); in (chunk, rank) order
    copies: int  # J
    overflow_from: int | None = None  # row_TC's columns from it on: copies past their chunk's bound, on rows of
    #                                   their own (the overflow chunk's), which few tokens have


def token_wire_rows(experts_TK: torch.Tensor, keep_TK: torch.Tensor | None, target_of_expert_E: torch.Tensor,
                    slot_of_target_V: torch.Tensor, copies: int, slots: bool = False) -> WireRows:
    """A token's distinct (chunk, rank) targets and their rows in the (chunk, rank, token) order; static shapes,
    no host sync. ``slot_of_target_V``: each target's place in the (chunk, rank) order. ``slots``: each target's
    rows in a slot of T rows of its own (its tokens first, in order; the rest unused), so that where a target's
    rows start and end does not depend on the routing (the copy-engine exchange: device_plan.py)."""
    T, K = experts_TK.shape
    V = slot_of_target_V.numel()
    C = min(K, V)
    target_TK, slots_TC = distinct_targets(experts_TK, keep_TK, target_of_expert_E, slot_of_target_V, C)
    # tokens packed by slot: the (chunk, rank, token) order; a token takes a target once, so a slot of T never drops
    row_TC, counts_slot_V, _ = copy_rows(slots_TC, V, T if slots else None)
    R = V * T if slots else T * C
    row_of_copy_TK, slot_TK, token_of_row_R = wire_copies(target_TK, row_TC, V, R)
    return WireRows(row_TC, token_of_row_R, row_of_copy_TK, slot_TK, counts_slot_V[slot_of_target_V], R, copies)


def token_rows(hidden_TX: torch.Tensor, wire: WireRows, rest_RM: torch.Tensor | None = None) -> GatheredRows:
    """The wire rows a token side sends: each its token's row of ``hidden_TX``, then its row of ``rest_RM`` (extra
    columns, if any), read from there by a transport that gathers (no send buffer written first), else written
    out (``write``: the tokens' rows permuted into place)."""
    R = wire.num_rows
    rest_RM = hidden_TX.new_empty((R, 0)) if rest_RM is None else rest_RM
    X = hidden_TX.shape[1]

    def write() -> torch.Tensor:
        send_RX = hidden_TX.new_empty((R, X + rest_RM.shape[1]))
        permute(hidden_TX, wire.row_TC, R, all_rows_mapped=True, out=send_RX[:, :X])  # past the wire rows: unread
        send_RX[:, X:] = rest_RM
        return send_RX

    return GatheredRows(rest_RM, hidden_TX, wire.token_of_row_R, write)


def dispatch_rows(x_TH: torch.Tensor, probs_TK: torch.Tensor, wire: WireRows, grouped_row_of_copy,
                  fp8: bool = False) -> GatheredRows:
    """The rows that cross to the experts: each wire row's hidden state (``fp8``: packed, :func:`packed_hidden`),
    then its J grouped rows and J probs as raw bits. ``grouped_row_of_copy``: returns each copy's grouped row at its
    destination (a host-planned plan waits for the counts there: the permutation is queued first)."""
    J = wire.copies
    hidden_TX = packed_hidden(x_TH, fp8)
    meta_RM = pack_copies(wire.row_of_copy_TK, wire.slot_TK, grouped_row_of_copy(), probs_TK.detach(), wire.num_rows,
                          _padded_words(2 * J), J)  # a copy past a bound (grouped row -1): none
    return token_rows(hidden_TX, wire, meta_RM.view(x_TH.dtype))


@dataclass
class ArrivedRows:
    """A chunk's received wire rows, split: the hidden states and each row's copies (sanitised)."""

    x_WH: torch.Tensor | Fp8Rows  # a view of the received rows (fp8: dequantized from them, or their FP8 parts)
    grouped_row_WJ: torch.Tensor  # int32 row of each copy in the chunk's grouped tensor; -1: none
    probs_WJ: torch.Tensor  # fp32


def arrived_rows(rows_WX: torch.Tensor, hidden: int, copies: int, offsets: torch.Tensor,
                 count: torch.Tensor | None, fp8: bool = False, keep_fp8: bool = False) -> ArrivedRows:
    """``count``: the chunk's received rows on the device (rows past it were never written: their copies are
    dropped), or None when every row is one. A grouped row past the chunk's last grouped-GEMM offset is dropped too
    (a compute-only reference lands a rank's own rows, whose copies belong elsewhere). ``fp8``: the hidden states
    crossed packed (:func:`hidden_states`); ``keep_fp8``: they stay so, views of their bytes and scales (for an FP8
    GEMM: :func:`copies_rows`)."""
    meta_WM = rows_WX[:, hidden_columns(hidden, rows_WX.dtype, fp8):].view(torch.int32)
    grouped_WJ, probs_WJ = unpack_copies(meta_WM, copies, offsets[-1:], count)
    if fp8 and keep_fp8:
        q_WH, scale_W = _packed_parts(rows_WX[:, :hidden_columns(hidden, rows_WX.dtype, True)], hidden)
        return ArrivedRows(Fp8Rows(q_WH, scale_W, rows_WX.dtype), grouped_WJ, probs_WJ)
    return ArrivedRows(hidden_states(rows_WX, hidden, fp8, count), grouped_WJ, probs_WJ)


def copies_rows(x_WH: torch.Tensor | Fp8Rows, grouped_row_WJ: torch.Tensor, num_rows: int, all_rows_mapped: bool,
                zero_below: torch.Tensor) -> torch.Tensor | Fp8Rows:
    """Each wire row's hidden state written to its copies' rows of the chunk's grouped tensor (``num_rows``; rows
    no copy maps to zero below ``zero_below`` unless ``all_rows_mapped``: permute). Rows in FP8 stay FP8: their
    bytes move as 32-bit words (the hidden size is a multiple of 16), their scales beside them, both contiguous."""
    if not isinstance(x_WH, Fp8Rows):
        return permute(x_WH, grouped_row_WJ, num_rows, all_rows_mapped, zero_below=zero_below)
    words_RH = permute(x_WH.q_RK.view(torch.int32), grouped_row_WJ, num_rows, all_rows_mapped, zero_below=zero_below)
    scales_R1 = permute(x_WH.scales[:, None], grouped_row_WJ, num_rows, all_rows_mapped, zero_below=zero_below)
    return Fp8Rows(words_RH.view(FP8), scales_R1[:, 0], x_WH.dtype)


def dgrad_rows(grad_x_RH: torch.Tensor, grouped_row_WJ: torch.Tensor, grad_probs_WJ: torch.Tensor | None
               ) -> torch.Tensor:
    """The dgrad rows that go back to the tokens: a wire row's copies' input gradients summed, with the probs'
    gradients in extra columns (if any), the sum written straight into the wider rows."""
    if grad_probs_WJ is None:
        return permute_backward(grad_x_RH, grouped_row_WJ)
    W, H = grouped_row_WJ.shape[0], grad_x_RH.shape[1]
    words_WM = _words(grad_probs_WJ.float().contiguous()).view(grad_x_RH.dtype)
    rows_WX = grad_x_RH.new_empty((W, H + words_WM.shape[1]))
    permute_backward(grad_x_RH, grouped_row_WJ, out=rows_WX[:, :H])
    rows_WX[:, H:] = words_WM
    return rows_WX


def token_grads(grad_RX: torch.Tensor, hidden: int, wire: WireRows, probs_dtype: torch.dtype | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The dispatch's backward on the token side: each token's wire rows' gradients summed, and (with
    ``probs_dtype``: the probs' gradient is wanted) each copy's prob gradient taken from its wire row's extra
    columns."""
    grad_TH = permute_backward(grad_RX[:, :hidden], wire.row_TC, sparse_from=wire.overflow_from)
    if probs_dtype is None:
        return grad_TH, None
    grads_RM = grad_RX[:, hidden:].view(torch.float32)
    return grad_TH, copy_grads(grads_RM, wire.row_of_copy_TK, wire.slot_TK).to(probs_dtype)
