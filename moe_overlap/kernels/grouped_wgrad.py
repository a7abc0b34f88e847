"""Grouped weight-gradient GEMM that accumulates into fp32 in place: out[e] += a_e^T @ b_e (one micro-batch's
rows, or several micro-batches' summed in the same program: see layers/experts.py,
``train.expert_wgrad_micro_batches``).

The rows of expert e are [offsets[e-1], offsets[e]) of a_TM and b_TN (offsets int32 on the device, rows past
the last offset never read), so the kernel serves the static worst-case buffers of the device-planned exchange and
runs inside CUDA graphs. Each program owns one (BLOCK_M, BLOCK_N) tile of one expert's output: it sums the
expert's rows in fp32 on the tensor cores and adds the tile into ``out`` (the parameter's fp32 main_grad)
once, so the bf16 gradient and the separate pass that added it never exist. torch._grouped_mm cannot do this
on torch 2.11 (it refuses an fp32 output for bf16 operands).

Either operand may be :class:`TokenRows`: rows that are copies of token rows, never written out, which the kernel
gathers as it reads them (at one EP rank with rowwise FP8 the permutation writes the experts' rows only in FP8, and
the bf16 weight gradients read the tokens' rows instead: train.fp8_gather_wgrad).

The torch twin (CPU, or without triton) is the grouped GEMM followed by the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_overlap.kernels.launch import HAVE_TRITON, Kernel, interpreter_requested, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    # Per segment (a micro-batch's rows), one element of each tuple: a, b, their end offsets and row strides; with
    # GATHER_A / GATHER_B the operand's rows are token rows picked by the copy index of each row (TokenRows), b's
    # times the copy's scale: SCALE 1, rounded to b's dtype as the rows it stands for were (bit for bit their sum);
    # SCALE 2, a's row times it instead (the same product, rounded on a's side: a's tile stays in registers).
    def _grouped_wgrad_kernel(a_ptrs, b_ptrs, offsets_ptrs, strides_a, strides_b, a_copies_ptrs, b_copies_ptrs,
                              b_scale_ptrs, copies_a, copies_b, out_ptr, M, N, stride_oe, stride_om,
                              SEGMENTS: tl.constexpr, GATHER_A: tl.constexpr, GATHER_B: tl.constexpr,
                              SCALE: tl.constexpr,
                              EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        expert = tl.program_id(1)
        # Tiles in groups of GROUP_M rows of tiles, so neighbouring programs share a's and b's columns in L2.
        tiles_m = (M + BLOCK_M - 1) // BLOCK_M
        tiles_n = (N + BLOCK_N - 1) // BLOCK_N
        group = pid // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        rows_of_group = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_of_group
        pid_n = (pid % (GROUP_M * tiles_n)) // rows_of_group
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        rows_seen = 0
        for segment in tl.static_range(SEGMENTS):  # each further segment: another micro-batch's rows, same sum
            a_base, b_base, offsets = a_ptrs[segment], b_ptrs[segment], offsets_ptrs[segment]
            step_a, step_b = strides_a[segment], strides_b[segment]
            start = tl.load(offsets + expert - 1, mask=expert > 0, other=0)
            end = tl.load(offsets + expert)
            rows_seen += end - start
            # Pointers made once and stepped (int64 only for the expert's first row): the per-iteration address
            # arithmetic of a [BLOCK_K, BLOCK_M] tile otherwise competes with the tensor cores. Gathered rows: each
            # step's row pointers from the copies' token indices.
            a_KM = a_base + start.to(tl.int64) * step_a + rk[:, None] * step_a + rm[None, :]
            b_KN = b_base + start.to(tl.int64) * step_b + rk[:, None] * step_b + rn[None, :]
            for k in range(0, end - start, BLOCK_K):
                in_rows_K = rk < end - start - k
                in_rows = in_rows_K[:, None]
                mask_a = in_rows if EVEN_M else in_rows & (rm[None, :] < M)
                mask_b = in_rows if EVEN_N else in_rows & (rn[None, :] < N)
                if GATHER_A:
                    copy_a = tl.load(a_copies_ptrs[segment] + start + k + rk, mask=in_rows_K, other=0)
                    a_KM = a_base + (copy_a // copies_a[segment]).to(tl.int64)[:, None] * step_a + rm[None, :]
                if GATHER_B:
                    copy_b = tl.load(b_copies_ptrs[segment] + start + k + rk, mask=in_rows_K, other=0)
                    b_KN = b_base + (copy_b // copies_b[segment]).to(tl.int64)[:, None] * step_b + rn[None, :]
                a_tile = tl.load(a_KM, mask=mask_a, other=0.0)
                b_tile = tl.load(b_KN, mask=mask_b, other=0.0)
                if SCALE > 0:
                    scale = tl.load(b_scale_ptrs[segment] + copy_b, mask=in_rows_K, other=0.0).to(tl.float32)
                    if SCALE == 1:
                        b_tile = (scale[:, None] * b_tile.to(tl.float32)).to(b_tile.dtype)
                    else:
                        a_tile = (scale[:, None] * a_tile.to(tl.float32)).to(a_tile.dtype)
                acc = tl.dot(tl.trans(a_tile), b_tile, acc)
                if not GATHER_A:
                    a_KM += BLOCK_K * step_a
                if not GATHER_B:
                    b_KN += BLOCK_K * step_b
        if rows_seen > 0:  # an expert without rows adds nothing
            out = out_ptr + expert.to(tl.int64) * stride_oe + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
            mask = (rm[:, None] < M) & (rn[None, :] < N)
            # An add in L2 rather than a load and a store: the SM does not wait for the old value (measured: a
            # quarter of the epilogue's cost). One program owns each element, so the sum is deterministic.
            tl.atomic_add(out, acc, mask=mask, sem="relaxed")

    _grouped_wgrad = Kernel(_grouped_wgrad_kernel)

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the best of benchmarks/step_kernels.py on an H200.
_CONFIG = (128, 128, 32, 4, 5)
_GATHER_CONFIG = (128, 128, 32, 4, 5)  # gathering either operand
_SCALE_SIDE = "b"  # where a gathered b's scales are applied: "b" (bit for bit the rows written) or "a"


@dataclass(frozen=True)
class TokenRows:
    """An operand's rows as copies of token rows, never written out: row r is ``tokens_TH[copy_R[r] // copies]``
    (copy c is copy c % copies of token c // copies), times ``scale_C[copy_R[r]]`` rounded to the tokens' dtype
    where given (the combine's output gradient rows: each copy's routing probability times its token's gradient,
    as kernels/permute.unpermute_backward writes them)."""

    tokens_TH: torch.Tensor
    copy_R: torch.Tensor  # int32 (or int64): the copy each row holds
    copies: int
    scale_C: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.copy_R.shape[0], self.tokens_TH.shape[1]))

    @property
    def dtype(self) -> torch.dtype:
        return self.tokens_TH.dtype

    def rows(self) -> torch.Tensor:
        """The rows written out (the twins, and the GEMMs that cannot gather)."""
        copy_R = self.copy_R.long()
        rows = self.tokens_TH.index_select(0, copy_R // self.copies)
        if self.scale_C is None:
            return rows
        return (self.scale_C.float()[copy_R, None] * rows.float()).to(self.tokens_TH.dtype)


Operand = torch.Tensor | TokenRows
Segment = tuple[Operand, Operand, torch.Tensor]  # (a_TM, b_TN, int32 end offsets per expert)


def written(rows: Operand) -> torch.Tensor:
    """``rows`` as a tensor (TokenRows gathered)."""
    return rows.rows() if isinstance(rows, TokenRows) else rows


def grouped_wgrad_accumulate_torch(segments: list[Segment], out_EMN: torch.Tensor) -> None:
    """Twin: each segment's grouped GEMM in the operands' dtype, then the fp32 sum."""
    for a_TM, b_TN, offsets_E in segments:
        if a_TM.shape[0]:
            out_EMN.add_(torch._grouped_mm(written(a_TM).t(), written(b_TN), offs=offsets_E).float())


def grouped_wgrad_accumulate_triton(segments: list[Segment], out_EMN: torch.Tensor,
                                    config: tuple[int, ...] | None = None, scale_side: str = _SCALE_SIDE) -> None:
    experts, M, N = out_EMN.shape
    if out_EMN.numel() == 0:
        return
    if not segments:
        raise ValueError("grouped_wgrad_accumulate sums one or more segments, got none")
    a_all, b_all, offsets_all = zip(*segments)
    gather_a, gather_b = (_same_kind(operands, name) for operands, name in ((a_all, "a"), (b_all, "b")))
    scale_b = gather_b and _same_kind([b.scale_C is not None for b in b_all], "b's scales")
    a_rows, b_rows = [_tokens(x) for x in a_all], [_tokens(x) for x in b_all]
    if any(a.stride(1) != 1 for a in a_rows) or any(b.stride(1) != 1 for b in b_rows) or out_EMN.stride(2) != 1:
        raise ValueError("grouped_wgrad_accumulate needs unit column strides (rows may be strided)")
    device = a_rows[0].device
    block_m, block_n, block_k, warps, stages = config or (_GATHER_CONFIG if gather_a or gather_b else _CONFIG)
    if device.type != "cuda" or interpreter_requested():  # the interpreter: small tiles keep the CPU tests quick
        block_m, block_n, block_k = min(block_m, 32), min(block_n, 32), min(block_k, 16)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n), experts)
    # operands that are not gathered pass unused pointers (their rows) and copies of 1
    a_copies = tuple(x.copy_R if gather_a else x for x in a_all)
    b_copies = tuple(x.copy_R if gather_b else x for x in b_all)
    b_scales = tuple(x.scale_C if scale_b else r for x, r in zip(b_all, b_rows))
    _grouped_wgrad[grid, device](
        tuple(a_rows), tuple(b_rows), offsets_all, tuple(x.stride(0) for x in a_rows),
        tuple(x.stride(0) for x in b_rows), a_copies, b_copies, b_scales,
        tuple(x.copies if gather_a else 1 for x in a_all), tuple(x.copies if gather_b else 1 for x in b_all),
        out_EMN, M, N, out_EMN.stride(0), out_EMN.stride(1), SEGMENTS=len(segments), GATHER_A=gather_a,
        GATHER_B=gather_b, SCALE=(0 if not scale_b else 1 if scale_side == "b" else 2), EVEN_M=M % block_m == 0, EVEN_N=N % block_n == 0, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=warps, num_stages=stages)


def _tokens(rows: Operand) -> torch.Tensor:
    """What the kernel reads rows from: the token rows of TokenRows, else the rows."""
    return rows.tokens_TH if isinstance(rows, TokenRows) else rows


def _same_kind(items, name: str) -> bool:
    """Whether every segment's ``name`` is TokenRows (or, for bools, true); mixed kinds are refused (one kernel
    compiled for all segments)."""
    kinds = {isinstance(x, TokenRows) if not isinstance(x, bool) else x for x in items}
    if len(kinds) > 1:
        raise ValueError(f"grouped_wgrad_accumulate: {name} is gathered in some segments and not in others")
    return kinds.pop()


def grouped_wgrad_accumulate(segments: list[Segment], out_EMN: torch.Tensor) -> None:
    """out_EMN[e] += sum over segments of a_TM[rows of e]^T @ b_TN[rows of e], in fp32 (``out_EMN`` fp32; a
    segment's rows of e between its int32 end offsets[e-1] and offsets[e]; one segment, or several: as many
    micro-batches' rows summed in registers, one add into ``out_EMN``). Either operand may be :class:`TokenRows`
    (the same kind in every segment)."""
    if use_triton(_tokens(segments[0][0]), "grouped_wgrad"):
        grouped_wgrad_accumulate_triton(segments, out_EMN)
    else:
        grouped_wgrad_accumulate_torch(segments, out_EMN)
