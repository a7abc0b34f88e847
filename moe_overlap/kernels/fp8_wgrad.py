"""FP8 weight gradients accumulated in fp32 in place: out[e] += a_e^T @ b_e over each group's rows (the experts'
grouped wgrad), the operands in E4M3 (``train.fp8_wgrad``).

A weight gradient contracts along the tokens, and FP8 tensor cores read only operands laid out along the
contraction, so each operand (a_TM: the GEMM input's rows, b_TN: the output gradient's) is quantized along the
tokens and written transposed, q (M, P) with the tokens contiguous (:func:`quantize_along_tokens`). Each group's
rows start at a multiple of 128 there (chunk c holds 128 tokens at columns [128 c, 128 c + 128); a group's last
chunk is padded with zeros): a tile starting at an unaligned token could not be loaded in 16-byte vectors. So
P = 128 x the chunks' bound, cdiv(T, 128) + groups, static for a static buffer of T rows.

Scales, one float32 per (chunk, column), stored (chunks, M):
- ``per_chunk`` (the blockwise recipe; DeepSeek-V3's 128x1 tiles for the weight gradient): each chunk's own.
  The GEMM sums each chunk's product in fp32 and multiplies it by its two scale vectors before adding it up.
- per group (the rowwise recipe; torchao's per-group column scales): the group's amax over all its rows, so
  the same scale in each of its chunks. The GEMM scales the group's product once, in the epilogue, and lets the
  tensor cores accumulate across the chunks (``fast_accum``, the default here), or sums each chunk's product in
  fp32 (Transformer Engine's choice for gradients). Measured on an H100 (step_kernels_fp8_wgrad_rows_1xh100.json,
  expert shapes at 4,096 rows per expert): the same error against fp32 (0.03745 against 0.03743; the quantization's
  own is 0.037) and 17-24% faster (Mixtral fc1 8.71 against 11.46 ms), since a chunk's product need not be waited
  for before the next one starts.

A scale is made as everywhere in kernels/fp8_quant.py (amax / 448, amax >= 1e-12, the values times 448 / amax
clamped and rounded to nearest even). The group boundaries are read on the device (int32 end offsets, the chunks'
end per group and each chunk's group: :func:`token_chunks`, :func:`group_of_chunks`, a few tiny device ops), so both
kernels run on a static grid, without a host sync, inside CUDA graphs. Rows past the last offset are never read.

Measured on an H100 (step_kernels_fp8_wgrad_rows_1xh100.json, per group): at 1,024 rows per expert the GEMM alone
runs about as fast as the bf16 kernel (Mixtral fc1 4.9-5.4 against 4.70 ms): the fp32 read-modify-write of
main_grad, not the arithmetic, bounds both there. At 4,096 rows it runs 1.7x bf16's (8.71 against 14.89 ms), but
quantizing both operands (then two launches per group scale, each reading every row from HBM) costs 3.4 ms there,
as many bytes as bf16 reads: the FP8 wgrad pays only where the experts are wide (its GEMM grows with rows x M x N,
the quantization with rows x (M + N)) and many rows share one read-modify-write (train.fp8_wgrad=auto:
config/defaults.py). The group scale's one launch (the second read from L2) takes 0.66-0.73x the two launches' time
(step_kernels_fp8_fuse_1xh100.json: a Mixtral-like layer's four operands 0.95 against 1.35 ms at 1,024 rows per
expert, 1.02 against 1.55 at 4,096; fine-grained 1.00 against 1.37).

The torch twins (CPU, the emulated path of layers/fp8.py, tests) loop over the groups on the host.
"""

from __future__ import annotations

import torch

from moe_overlap.kernels.fp8_quant import FP8, quantize_along_torch
from moe_overlap.kernels.launch import HAVE_TRITON, Kernel, interpreter_requested, max_combine, use_triton

CHUNK = 128  # tokens per chunk: a scale's span along the contraction, and one tl.dot's depth

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from moe_overlap.kernels.fp8_quant import TL_AMAX_FLOOR as _FLOOR, TL_FP8_MAX as _MAX
    from moe_overlap.kernels.launch import tile_in_groups

    # One program per (chunk, BLOCK_C columns). MODE 0: the chunk's column amax into amax (C, M); 1: the chunk
    # quantized with its own amax; 2: with its group's (the max over the group's chunks, which mode 0 wrote).
    # Values stored transposed (the tokens contiguous); a chunk's rows past its group's end as zeros.
    def _quantize_chunks_kernel(x_ptr, q_ptr, scale_ptr, amax_ptr, offsets_ptr, chunk_ends_ptr, group_of_chunk_ptr, M,
                                E, P, stride_x, MODE: tl.constexpr, BLOCK_C: tl.constexpr):
        chunk = tl.program_id(0)
        # The chunk's group (E: past the last group's chunks, dead), its rows and the group's chunks
        group = tl.load(group_of_chunk_ptr + chunk)
        if group < E:
            first_chunk = tl.load(chunk_ends_ptr + group - 1, mask=group > 0, other=0)
            end_chunk = tl.load(chunk_ends_ptr + group)
            first_row = tl.load(offsets_ptr + group - 1, mask=group > 0, other=0) + (chunk - first_chunk) * 128
            end_row = tl.load(offsets_ptr + group)
            rows = first_row + tl.arange(0, 128)
            cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
            in_cols = cols < M
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :],
                        mask=(rows < end_row)[:, None] & in_cols[None, :], other=0.0).to(tl.float32)
            amax = tl.reduce(tl.abs(x), 0, max_combine)
            if MODE == 0:
                tl.store(amax_ptr + chunk.to(tl.int64) * M + cols, amax, mask=in_cols)
            else:
                if MODE == 2:
                    group_amax = amax_ptr + first_chunk.to(tl.int64) * M + cols
                    for _ in range(first_chunk, end_chunk):
                        amax = tl.maximum(amax, tl.load(group_amax, mask=in_cols, other=0.0))
                        group_amax += M
                amax = tl.maximum(amax, _FLOOR)
                fp8_max = tl.full((BLOCK_C,), _MAX, tl.float32)
                tl.store(scale_ptr + chunk.to(tl.int64) * M + cols, tl.math.div_rn(amax, fp8_max), mask=in_cols)
                q = tl.minimum(tl.maximum(x * tl.math.div_rn(fp8_max, amax)[None, :], -_MAX), _MAX)
                tokens = chunk.to(tl.int64) * 128 + tl.arange(0, 128)
                tl.store(q_ptr + cols[None, :].to(tl.int64) * P + tokens[:, None], q.to(q_ptr.dtype.element_ty),
                         mask=in_cols[None, :])

    _quantize_chunks = Kernel(_quantize_chunks_kernel)

    # The group scale in one launch: one program per (group, BLOCK_C columns) reads the group's chunks twice, their
    # column amax and then the quantized values, the second time from L2 (the program's strip of the group, rows x
    # BLOCK_C x 2 bytes), where MODE 0 and 2 read every row from HBM twice. The same values and scales as those two.
    def _quantize_groups_kernel(x_ptr, q_ptr, scale_ptr, offsets_ptr, chunk_ends_ptr, M, P, stride_x,
                                BLOCK_C: tl.constexpr):
        group = tl.program_id(0)
        first_chunk = tl.load(chunk_ends_ptr + group - 1, mask=group > 0, other=0)
        end_chunk = tl.load(chunk_ends_ptr + group)
        first_row = tl.load(offsets_ptr + group - 1, mask=group > 0, other=0)
        end_row = tl.load(offsets_ptr + group)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        in_cols = cols < M
        rows = first_row + tl.arange(0, 128)
        amax = tl.full((BLOCK_C,), 0.0, tl.float32)
        for _ in range(first_chunk, end_chunk):
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :],
                        mask=(rows < end_row)[:, None] & in_cols[None, :], other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.reduce(tl.abs(x), 0, max_combine))
            rows += 128
        amax = tl.maximum(amax, _FLOOR)
        fp8_max = tl.full((BLOCK_C,), _MAX, tl.float32)
        scale = tl.math.div_rn(amax, fp8_max)
        inverse = tl.math.div_rn(fp8_max, amax)
        rows = first_row + tl.arange(0, 128)
        tokens = first_chunk.to(tl.int64) * 128 + tl.arange(0, 128)
        chunk_scale = scale_ptr + first_chunk.to(tl.int64) * M + cols
        for _ in range(first_chunk, end_chunk):
            tl.store(chunk_scale, scale, mask=in_cols)
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :],
                        mask=(rows < end_row)[:, None] & in_cols[None, :], other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(x * inverse[None, :], -_MAX), _MAX)
            tl.store(q_ptr + cols[None, :].to(tl.int64) * P + tokens[:, None], q.to(q_ptr.dtype.element_ty),
                     mask=in_cols[None, :])
            rows += 128
            tokens += 128
            chunk_scale += M

    _quantize_groups = Kernel(_quantize_groups_kernel)

    # One program per (BLOCK_M, BLOCK_N) tile of one group's output, the group's chunks in turn (one to four
    # segments: micro-batches' rows, each with its own chunks and scales; per segment a and b as TMA descriptors,
    # one argument each (triton 3.6's launcher takes none inside tuples), and one element of each tuple: a's
    # scales, b's, the chunks' ends per group). The TMA reads the chunks' tiles, pipelined: loads through pointer
    # tensors compile for sm_90 unpipelined and spilling (fp8_wgrad_tma_1xh200.json: 12-14% slower at the
    # Mixtral-like shapes), and it fills rows past M or N with zeros. The tile is added into out (the fp32
    # main_grad) once, in L2 (an atomic add: the SM does not wait for the old value; one program per element, so
    # the sum is deterministic), as kernels/grouped_wgrad.py's bf16 kernel.
    def _fp8_wgrad_kernel(a0, a1, a2, a3, a_scale_ptrs, b0, b1, b2, b3, b_scale_ptrs, chunk_ends_ptrs, out_ptr, M, N,
                          stride_oe, stride_om,
                          SEGMENTS: tl.constexpr, PER_CHUNK: tl.constexpr, FAST_ACCUM: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        group = tl.program_id(1)
        pid_m, pid_n = tile_in_groups(pid, (M + BLOCK_M - 1) // BLOCK_M, (N + BLOCK_N - 1) // BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        in_m = rm < M
        in_n = rn < N
        acc_MN = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        chunks_seen = 0
        for segment in tl.static_range(SEGMENTS):
            if segment == 0:
                a_desc, b_desc = a0, b0
            elif segment == 1:
                a_desc, b_desc = a1, b1
            elif segment == 2:
                a_desc, b_desc = a2, b2
            else:
                a_desc, b_desc = a3, b3
            a_scale, b_scale, chunk_ends = a_scale_ptrs[segment], b_scale_ptrs[segment], chunk_ends_ptrs[segment]
            first = tl.load(chunk_ends + group - 1, mask=group > 0, other=0)
            end = tl.load(chunk_ends + group)
            chunks_seen += end - first
            scale_a_M = a_scale + first.to(tl.int64) * M + rm  # the first chunk's scales (the group's, per group)
            scale_b_N = b_scale + first.to(tl.int64) * N + rn
            chunk_a_M, chunk_b_N = scale_a_M, scale_b_N  # per chunk: stepped along the chunks
            segment_MN = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            for chunk in tl.range(first, end):
                # a (M, P) and b (N, P), the tokens contiguous: tiles (BLOCK_M, 128) and (BLOCK_N, 128)
                a = a_desc.load([pid_m * BLOCK_M, chunk * 128])
                b = tl.trans(b_desc.load([pid_n * BLOCK_N, chunk * 128]))
                if PER_CHUNK:  # the chunk's product alone, times its scales, into the fp32 sum
                    scale_a = tl.load(chunk_a_M, mask=in_m, other=0.0)
                    scale_b = tl.load(chunk_b_N, mask=in_n, other=0.0)
                    segment_MN += tl.dot(a, b) * scale_a[:, None] * scale_b[None, :]
                    chunk_a_M += M
                    chunk_b_N += N
                elif FAST_ACCUM:  # the tensor cores' own accumulation across the chunks
                    segment_MN = tl.dot(a, b, segment_MN)
                else:  # each chunk's product summed in fp32
                    segment_MN += tl.dot(a, b)
            if PER_CHUNK:
                acc_MN += segment_MN
            elif end > first:  # the group's scales, the same in each of its chunks
                scale_a = tl.load(scale_a_M, mask=in_m, other=0.0)
                scale_b = tl.load(scale_b_N, mask=in_n, other=0.0)
                acc_MN += segment_MN * scale_a[:, None] * scale_b[None, :]
        if chunks_seen > 0:  # a group without rows adds nothing
            out = out_ptr + group.to(tl.int64) * stride_oe + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
            tl.atomic_add(out, acc_MN, mask=in_m[:, None] & in_n[None, :], sem="relaxed")

    _fp8_wgrad = Kernel(_fp8_wgrad_kernel)


def token_chunks(offsets_E: torch.Tensor) -> torch.Tensor:
    """Each group's end in chunks of 128 rows (int32 (E,), cumulative: group e owns chunks [ends[e-1], ends[e])),
    from its int32 end offsets, on the device."""
    rows_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
    return torch.cumsum(torch.div(rows_E + (CHUNK - 1), CHUNK, rounding_mode="floor"), 0).to(torch.int32)


def group_of_chunks(chunk_ends_E: torch.Tensor, chunks: int) -> torch.Tensor:
    """The group of each of ``chunks`` chunks (int32; E for a chunk past the last group's), on the device: one
    search for all, rather than each program walking the E groups."""
    return torch.searchsorted(chunk_ends_E, torch.arange(chunks, device=chunk_ends_E.device, dtype=torch.int32),
                              right=True).to(torch.int32)


def chunks_bound(rows: int, groups: int) -> int:
    """The most chunks ``rows`` rows in ``groups`` groups can take (each group's last chunk may be partial)."""
    return -(-rows // CHUNK) + groups


class TokenQuantized:
    """An operand of the FP8 weight gradient, quantized along the tokens (:func:`quantize_along_tokens`)."""

    def __init__(self, q_MP: torch.Tensor, scale_CM: torch.Tensor, chunk_ends_E: torch.Tensor):
        self.q_MP = q_MP  # E4M3 (or float32 holding E4M3 values, the CPU interpreter's tests), tokens contiguous
        self.scale_CM = scale_CM  # float32, one per (chunk, column)
        self.chunk_ends_E = chunk_ends_E

    def dequantized(self) -> torch.Tensor:
        """fp32 (M, P): each chunk's values times its scales (the twin's operand)."""
        return self.q_MP.float() * self.scale_CM.t().repeat_interleave(CHUNK, 1)


def quantize_along_tokens_torch(x_TM: torch.Tensor, offsets_E: torch.Tensor, per_chunk: bool) -> TokenQuantized:
    """Twin (a host loop over the groups; chunks past the last group's zeros)."""
    M = x_TM.shape[1]
    chunk_ends = token_chunks(offsets_E)
    bound = chunks_bound(x_TM.shape[0], offsets_E.numel())
    q_MP = torch.zeros((M, bound * CHUNK), dtype=FP8, device=x_TM.device)
    scale_CM = torch.zeros((bound, M), dtype=torch.float32, device=x_TM.device)
    start, first = 0, 0
    for end, chunks_end in zip(offsets_E.tolist(), chunk_ends.tolist()):
        chunks = chunks_end - first
        if chunks:
            x = torch.zeros((chunks * CHUNK, M), dtype=torch.float32, device=x_TM.device)
            x[:end - start] = x_TM[start:end].float()
            x = x.reshape(chunks, CHUNK, M)
            amax = x.abs().amax(1)
            if not per_chunk:
                amax = amax.amax(0, keepdim=True).expand(chunks, M)
            q, scale = quantize_along_torch(x, 1, amax)
            q_MP[:, first * CHUNK:chunks_end * CHUNK] = q.reshape(chunks * CHUNK, M).t()
            scale_CM[first:chunks_end] = scale
        start, first = end, chunks_end
    return TokenQuantized(q_MP, scale_CM, chunk_ends)


_CHUNK_COLUMNS = 64  # BLOCK_C of the per-chunk passes: a program's columns (128 tokens each)
_GROUP_COLUMNS = 64  # BLOCK_C of the one-pass group kernel: the fastest of 16-128 (step_kernels_fp8_fuse_1xh100.json)


def quantize_along_tokens(x_TM: torch.Tensor, offsets_E: torch.Tensor, per_chunk: bool, columns: int | None = None,
                          one_pass: bool = True) -> TokenQuantized:
    """x_TM (rows grouped by the int32 end offsets ``offsets_E``; rows past the last one not read) quantized along
    its rows, transposed: q (M, P) E4M3, scales (chunks, M); see the module docstring. Per chunk: one Triton pass.
    Per group: one launch that reads each group's rows twice, the second time from L2 (``one_pass``; False: two
    launches over the chunks, the group's amax between them, for benchmarks). ``columns``: a program's (benchmarks)."""
    if not use_triton(x_TM, "fp8 quantize_along_tokens"):
        return quantize_along_tokens_torch(x_TM, offsets_E, per_chunk)
    T, M = x_TM.shape
    if x_TM.stride(1) != 1:
        x_TM = x_TM.contiguous()
    bound = chunks_bound(T, offsets_E.numel())
    chunk_ends = token_chunks(offsets_E)
    q_MP = torch.empty((M, bound * CHUNK), dtype=FP8, device=x_TM.device)
    scale_CM = torch.empty((bound, M), dtype=torch.float32, device=x_TM.device)
    groups = not per_chunk and one_pass
    block_c = min(columns or (_GROUP_COLUMNS if groups else _CHUNK_COLUMNS), triton.next_power_of_2(M))
    warps = 4 if block_c <= 64 else 8
    if groups:
        _quantize_groups[(offsets_E.numel(), triton.cdiv(M, block_c)), x_TM.device](
            x_TM, q_MP, scale_CM, offsets_E, chunk_ends, M, bound * CHUNK, x_TM.stride(0), BLOCK_C=block_c,
            num_warps=warps)
        return TokenQuantized(q_MP, scale_CM, chunk_ends)
    grid = (bound, triton.cdiv(M, block_c))
    modes = (1,) if per_chunk else (0, 2)
    amax_CM = scale_CM if per_chunk else torch.empty_like(scale_CM)
    group_of_chunk = group_of_chunks(chunk_ends, bound)
    for mode in modes:
        _quantize_chunks[grid, x_TM.device](x_TM, q_MP, scale_CM, amax_CM, offsets_E, chunk_ends, group_of_chunk, M,
                                            offsets_E.numel(), bound * CHUNK, x_TM.stride(0), MODE=mode,
                                            BLOCK_C=block_c, num_warps=warps)
    return TokenQuantized(q_MP, scale_CM, chunk_ends)


Segment = tuple[TokenQuantized, TokenQuantized]  # (a: the GEMM input's rows, b: the output gradient's)


def fp8_wgrad_accumulate_torch(segments: list[Segment], out_EMN: torch.Tensor) -> None:
    """Twin: per segment and group, the dequantized chunks' fp32 product, added into ``out_EMN``."""
    for a, b in segments:
        a_MP, b_NP = a.dequantized(), b.dequantized()
        first = 0
        for group, end in enumerate(a.chunk_ends_E.tolist()):
            if end > first:
                columns = slice(first * CHUNK, end * CHUNK)
                out_EMN[group] += a_MP[:, columns] @ b_NP[:, columns].t()
            first = end


# (BLOCK_M, BLOCK_N, warps, stages); the depth is a chunk's 128. Per chunk (blockwise): 64 x 128 in one warp
# group, the fastest of benchmarks/step_kernels.py --sections fp8_wgrad on an H100 while the loads went through
# pointers (step_kernels_fp8_wgrad_1xh100.json; not swept again since). Per group: 128 x 256 in two warp groups, the
# fastest at four micro-batches a call since the TMA feeds the loop (fp8_wgrad_tma_1xh200.json, an H200: Mixtral fc1
# 9.50 ms against 10.25 at 128 x 128) and within 4% of the fastest at one.
_CONFIG_CHUNK = (64, 128, 4, 4)
_CONFIG_GROUP = (128, 256, 8, 3)
_SEGMENTS_A_LAUNCH = 4


def fp8_wgrad_accumulate_triton(segments: list[Segment], out_EMN: torch.Tensor, per_chunk: bool,
                                fast_accum: bool | None = None, config: tuple[int, ...] | None = None) -> None:
    """:func:`fp8_wgrad_accumulate` in one launch; ``fast_accum`` (per group only; default there) and the tile
    ``config`` (BLOCK_M, BLOCK_N, warps, stages; default by mode) for tests and benchmarks."""
    groups, M, N = out_EMN.shape
    if out_EMN.numel() == 0:
        return
    if not segments:
        raise ValueError("fp8_wgrad_accumulate sums one or more segments, got none")
    if out_EMN.dtype != torch.float32 or out_EMN.stride(2) != 1:
        raise ValueError(f"out_EMN must be float32 with unit column stride, got {out_EMN.dtype} {out_EMN.stride()}")
    for a, b in segments:
        if a.q_MP.shape[0] != M or b.q_MP.shape[0] != N or a.q_MP.shape[1] != b.q_MP.shape[1] or \
                a.chunk_ends_E.numel() != groups:
            raise ValueError(f"operands {tuple(a.q_MP.shape)} and {tuple(b.q_MP.shape)} with "
                             f"{a.chunk_ends_E.numel()} groups do not fit out {tuple(out_EMN.shape)}")
    fast_accum = not per_chunk if fast_accum is None else fast_accum and not per_chunk
    block_m, block_n, warps, stages = config or (_CONFIG_CHUNK if per_chunk else _CONFIG_GROUP)
    if not out_EMN.is_cuda or interpreter_requested():  # the interpreter: small tiles keep the CPU tests quick
        block_m, block_n = min(block_m, 32), min(block_n, 32)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n), groups)
    for first in range(0, len(segments), _SEGMENTS_A_LAUNCH):  # more segments: one more launch each four, adding
        a_all, b_all = zip(*segments[first:first + _SEGMENTS_A_LAUNCH])
        a_descs = [TensorDescriptor.from_tensor(a.q_MP, [block_m, CHUNK]) for a in a_all]
        b_descs = [TensorDescriptor.from_tensor(b.q_MP, [block_n, CHUNK]) for b in b_all]
        unused = _SEGMENTS_A_LAUNCH - len(a_descs)  # the kernel reads none of these
        _fp8_wgrad[grid, out_EMN.device](
            *a_descs, *a_descs[:1] * unused, tuple(a.scale_CM for a in a_all), *b_descs, *b_descs[:1] * unused,
            tuple(b.scale_CM for b in b_all), tuple(a.chunk_ends_E for a in a_all), out_EMN, M, N, out_EMN.stride(0),
            out_EMN.stride(1), SEGMENTS=len(a_descs), PER_CHUNK=per_chunk, FAST_ACCUM=fast_accum, BLOCK_M=block_m,
            BLOCK_N=block_n, GROUP_M=8, num_warps=warps, num_stages=stages)


def fp8_wgrad_accumulate(segments: list[Segment], out_EMN: torch.Tensor, per_chunk: bool) -> None:
    """out_EMN[e] (fp32) += sum over segments of a_e^T @ b_e, from operands quantized along the tokens (both of a
    segment with the same ``per_chunk``, the recipe's; see the module docstring)."""
    if use_triton(out_EMN, "fp8 wgrad"):
        fp8_wgrad_accumulate_triton(segments, out_EMN, per_chunk)
    else:
        fp8_wgrad_accumulate_torch(segments, out_EMN)
