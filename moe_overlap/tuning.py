"""Measured constants of the overlaps (the MoE exchange's and the data-parallel syncs'), each with where and when
it was measured (README, "What overlaps on Hopper"; the JSON under benchmarks/results/ holds the commands).
``overlap.gemm_sm_carveout: auto`` and ``overlap.moe_pipeline: auto`` (config/defaults.py) read them. Pure
numbers, no torch.
"""

from __future__ import annotations

import math

# What ``overlap.moe_pipeline: auto`` runs where there is an exchange (EP x expert-TP > 1), by how the micro-batches
# run. The transport follows the fabric (distributed/a2a.py): on one host with peer access, sm_push for device sizes
# and copy_engine for host sizes; elsewhere nccl (host sizes). copy_engine with device sizes (wire rows in slots of a
# micro-batch's tokens, graphed) tied with sm_push where both pair on two streams, so auto keeps sm_push: the fine
# bench model at EP=2 208,368 tokens/s against 209,026 / 209,689 balanced, 195,710 against 197,741 on real text
# (2xH200, 2026-11-30, train_step_fine_8l_ep2_{balanced,text}_ce_streams_2xh200.json).
#   plain: the pipeline, one chunk, planned where the fabric allows (device: sm_push, graph-replayable; else host).
#     Per-GPU MFU, pipeline vs serial exchange: 2xH100 EP=2, 2026-11-26 (benchmarks/results/train_step_*_ep2_*):
#     fine-grained 0.473 vs 0.420 balanced, 0.419 vs 0.374 real text; Mixtral-like 0.625 vs 0.596 balanced, 0.483
#     vs 0.460 real text. 4xH100 EP=4, 2026-11 (issue 38's table): 0.319-0.357 vs 0.299-0.339 fine-grained,
#     0.336/0.593 vs 0.326/0.588 Mixtral-like. More chunks lost there (the only 2-chunk EP=4 row: 0.343); again
#     with forced routing that spreads, device-planned and graphed (bound 1.25), 4xH100 EP=4 fine-grained,
#     2026-11-27, one launch: 1 chunk 0.486, 2 chunks 0.420 / 0.413 / 0.397 at carve-out auto / 16 / 64 push CTAs
#     (..._ep4_balanced_spread_fused_4xh100.json).
#     Without peer access auto plans on the host over nccl, one all-to-all each way on the exchange's stream. 4xH100
#     EP=4 through host memory (NCCL_P2P_DISABLE=1), balanced, 2026-11-27: fine-grained 0.348 (its compute-only
#     limit 0.345); Mixtral-like 0.478-0.496, where pairing reached 0.517 and 2 chunks 0.511
#     (benchmarks/results/train_step_*_ep4_balanced_slow*_4xh100.json). The fine-grained model the other way round:
#     one chunk 0.323, paired 0.275, 2 chunks 0.251 (its compute-only row 0.304; 2026-11-27,
#     ..._slow_paired_4xh100.json), but with the round-robin forced routing that kept a token's copies on one rank.
#     With forced routing that spreads them as a router does (3.7x the remote rows), one launch, 2026-11-27 evening
#     (..._slow_spread_variants_4xh100.json): one chunk 0.214, paired 0.238, 2 chunks 0.187 (compute-only 0.299).
#   paired (overlap_moe_expert_parallel_comm): planning left to the transport's auto (device planning where sm_push
#     runs), the pushes on the side stream with the CTAs gemm_sm_carveout auto leaves them beside the MoE GEMMs.
#     With carve-out 0 the pushes ran on the compute stream, so nothing of one micro-batch's exchange ran under the
#     other's compute: 4xH100 EP=4 fine-grained balanced, 0.219 device-planned at carve-out 0 vs 0.241 host-planned
#     over copy_engine (2026-11-27, ..._ep4_balanced_paired_4xh100.json); then in one launch 0.434 device-planned at
#     carve-out auto vs 0.323 over copy_engine (the unpaired default 0.519; ..._ep4_balanced_paired_auto_4xh100.json).
#     Earlier, uniform ids: 0.364 over copy_engine vs 0.333 over nccl uncapped and 0.239 at 4 CTAs (issue 38's
#     table). PP=2 x EP=2 rows swing by a third between launches of the same config (eager MoE layers, host-bound:
#     unpaired 0.317 / 0.427 / 0.379 / 0.321 on 4xH100, 2026-11-27, ..._pp2_ep2_{device,diag,paired_auto}_4xh100.json).

# ``overlap.overlap_moe_expert_parallel_comm: auto`` pairs micro-batches where the exchange runs over NCCL (no peer
# copies: EP across hosts, or moe_transport=nccl), whatever the router's top-k: there the other micro-batch's compute
# hides the exchange. 4xH100 EP=4 through host memory (NCCL_P2P_DISABLE=1), balanced, 2026-11-27 (the rows above):
# Mixtral-like (top-2) paired 0.517 against 0.478 unpaired, 1.14x against 1.23x its compute-only step; with auto in
# one launch (..._slow_auto_4xh100.json) paired by itself 0.520 against 0.478 unpaired (1.096x against 1.194x
# compute-only). Fine-grained (top-8) with routing that spreads: paired 0.238 against 0.214 (1.26x against 1.40x
# compute-only); it lost (0.275 against 0.323) only with the round-robin routing that sent few rows, and auto left
# it unpaired until then. On one NVLink host the unpaired pipeline (device-planned, graphed) measured fastest for
# both (fine-grained EP=4: graphed 0.504, eager 0.305, paired eager 0.269, ..._ep4_balanced_spread_eager_4xh100.json),
# so auto leaves eager pairs off there. Paired with graphed layers (each pair's halves on two CUDA streams, explicit
# train.moe_cuda_graph=true) was faster there since (2xH200, 2026-11-28,
# train_step_*_ep2_balanced_streams*_2xh200.json):
# fine-grained EP=2 0.5977 / 0.5816 / 0.5819 against 0.5819 / 0.5656 / 0.5665 unpaired graphed (+2.7%), Mixtral-like
# 0.6535 against 0.6480 (+0.8%), one GPU +2.2% (train_step_streams_fine_8l_1xh200.json); fine-grained EP=4 0.5573
# against 0.5406 (+3.0%, 4xH200, 2026-11-29, train_step_fine_8l_ep4_balanced_streams_x4_4xh200.json); with a bound of
# 1.25 at EP=2 0.5915 against 0.5745 (+3.0%, 1.040x compute-only; 2xH200, 2026-11-29 night,
# train_step_fine_8l_ep2_balanced_streams_workspace_2xh200.json). So on one host with peer access, auto pairs on two
# streams (graphed) at the expert-rank counts in STREAMS_EXPERT_RANKS where they fit the GPU (below); EP=4 ran faster
# too, but hung on streams with a bound (configs/gpu4_fine.yaml) before the graphs' shared cuBLAS workspace was found
# (layers/moe.py, capture_moe_layers), and no 4-GPU machine has run it since. As auto chose it (2xH200, 2026-11-30,
# train_step_*_auto_streams*_2xh200.json): the fine bench model at EP=2 0.5988 against 0.5813 unpaired (+3.0%),
# configs/gpu2_fine.yaml +3.7%, configs/gpu2_mixtral.yaml +1.5%; capped at 76 GiB (an 80 GB H100) it chose unpaired
# for the fine bench model and streams with a bound of 1.25, which ran within the cap; in rowwise FP8 0.6658 against
# 0.6315 (+5.4%, ..._auto_streams_fp8_2xh200.json). One GPU with train.moe_cuda_graph=true too (auto graphs only
# with an exchange), where nothing is exchanged but the second stream fills the gaps between kernels: the fine bench
# model +2.2% bf16 and +2.3% rowwise (1xH200, 2026-11-28, train_step_streams_fine_8l_1xh200.json), +1.6% on the
# tree with one gradient placeholder (2026-11-29, train_step_placeholder_streams_fine_8l_1xh200.json).
STREAMS_EXPERT_RANKS = (1, 2)
# On streams a one-chunk SM push runs at the full chip. Held to fewer CTAs (overlap.ep_comm_ctas, no carve-out) it
# only slowed the step, monotonically: the fine bench model at EP=2 0.5315 / 0.5631 / 0.5759 at 8 / 16 / 32 CTAs
# against 0.5813 at the full chip, 0.5631 with the paired GEMMs carved out by 16 too (the eager ones only: the graphed
# MoE layers' grouped GEMMs, captured with one chunk, carry no carve-out); configs/gpu2_fine.yaml the same
# way (2xH200, 2026-11-30, train_step_{fine_8l_ep2_balanced,gpu2_fine}_push_ctas_2xh200.json); again at 32 with the
# time both streams were held counted, 21.6 / 25.5 ms a step against 10.6 / 13.6 at the full chip, 1.074x compute_only
# against 1.066x (..._balanced_ctas_exposed_2xh200.json): the smaller push's longer transfer. So auto pairs on streams
# with one chunk and no delayed weight gradients: in one launch (..._streams_more_2xh200.json, the same day) the config
# 0.5917 / 0.5922, delayed weight gradients 0.5881, 2 chunks 0.5418, the shared expert after the combine 0.5872.

# What pairs on two streams reserve (training/streams_memory.py): the model state, and twice (a graph set and one
# micro-batch's dense activations). A graph set is its MoE layer calls' stashes (layers/exchange_memory.py) and
# STREAMS_GRAPH_SPARE_CALLS calls' more of temporaries; the dense activations STREAMS_DENSE_WIDTHS hidden-wide tensors
# a token and layer. Set against the reserved memory measured on streams (2xH200 unless said, GiB, estimate / measured):
# the fine bench model at EP=2 70.0 / 69.9 (train_step_fine_8l_ep2_balanced_streams_2xh200.json), bounded at 1.25
# 58.7 / 58.7 (..._streams_workspace_2xh200.json), at EP=4 85.7 / 84.5 (4xH200,
# ..._ep4_balanced_streams_x4_4xh200.json);
# configs/gpu2_fine.yaml 101.2 / 99.3 (train_step_gpu2_fine_streams_2xh200.json), bounded at 1.5 90.7 / 88.3
# (train_step_gpu2_fine_streams_bound_workspace_2xh200.json), one graph set's pool 21.0 / 21.35
# (train_step_gpu2_fine_streams_pools_2xh200.json); configs/gpu4_fine.yaml 126.5 / 119.3 (4xH200, at one hardware
# queue: RESULTS.md, "The hardware queues"). tests/test_streams_memory.py holds them.
# The Mixtral-like bench model at EP=2 reserved more than estimated: 4 layers 78.8 against 69.1 (peak allocated 67.4;
# train_step_mixtral_2l_ep2_balanced_streams_2xh200.json), 2 layers 46.0 against 38.0 (peak 35.5;
# ..._triple_2xh200.json), so auto pairs on streams only within STREAMS_MEMORY_MARGIN of the allocator's budget.
STREAMS_GRAPH_SPARE_CALLS = 2
STREAMS_DENSE_WIDTHS = 20
STREAMS_MEMORY_MARGIN = 0.9
# What a rank holds outside torch's allocator (the CUDA context, NCCL, the symmetric regions): 3.26 GiB unpaired,
# 3.53 on streams, configs/gpu2_fine.yaml on 2xH200 (train_step_gpu2_fine_streams_cap76_pools_2xh200.json).
OUTSIDE_ALLOCATOR_BYTES = 4 * 2**30

# ``train.moe_cuda_graph: auto`` replays the MoE layers from CUDA graphs where the exchange is planned on the device
# (sm_push: one host with peer access), unpaired: fine-grained EP=4, forced routing that spreads, 4xH100, 2026-11-27,
# one launch: graphed 0.504, eager 0.305 (..._ep4_balanced_spread_eager_4xh100.json; eager, the compute stream waited
# 498 ms at the signals and idled 395 ms of a 1.48 s profiled step, graphed idle 41 ms). Not measured against eager
# with one expert rank, where auto leaves it off; bf16 only (config/defaults.py).

# ``overlap.moe_dispatch_once_per_rank: auto`` turns it on (with the pipeline) from this router top-k up: a token's
# copies then often share a rank, and the wire carries each token once per (chunk, rank) instead of once per copy.
# Per-GPU MFU, the default path (device-planned sm_push, 1 chunk, graphed) without -> with it, balanced routing:
# fine-grained (top-8 of 64) 2xH100 EP=2 0.475 -> 0.513 (rows -75%), 4xH100 EP=4 0.420 -> 0.474 (rows -54%);
# Mixtral-like (top-2 of 8) 4xH100 EP=4 0.620 -> 0.616 (rows -7%: within the launch's noise), 2026-11-26
# (benchmarks/results/train_step_*_ep{2,4}_*balanced_*xh100.json).
ONCE_PER_RANK_MIN_TOPK = 4

# ``model.moe_shared_expert_overlap: auto`` runs the shared expert beside the combine's transfers wherever the
# pipelined exchange runs: 4xH100 EP=4 fine-grained, forced routing that spreads, the default path otherwise, two
# launches, 2026-11-27: 0.504 and 0.505 against 0.499 and 0.500 after the combine (exposed EP 65 / 61 against 110 / 109
# ms a step) (benchmarks/results/train_step_fine_8l_ep4_balanced_spread_slices{,x}_4xh100.json); EP=2 on GPUs 0-1 of
# that host: 0.532 against 0.530 (..._ep2_balanced_spread_shared_2xh100.json). Not measured paired.
#
# ``overlap.moe_token_slices`` stays 1: two slices measured slower, 4xH100 EP=4 fine-grained, the same rows, one
# launch (..._slicesx_4xh100.json): 0.447 (carve-out auto, 32 SMs), 0.447 at 16, 0.423 at 64, and 0.453 with
# carve-out 0 (nothing overlapped: what slicing itself costs), against 0.500 unsliced.

# ``overlap.delay_wgrad_compute: auto`` turns it on with one device-planned chunk (each token once per rank,
# unpaired): the backward's transfer back then leaves on the side stream, with the CTAs gemm_sm_carveout auto gives
# the pushes, beside the experts' weight gradients, instead of after them on the compute stream. 4xH100 EP=4,
# fine-grained, forced balancing that spreads, graphed, 2026-11-27: per-GPU MFU 0.479 against 0.467 (exposed EP
# 110 against 144 ms a step; auto gave the pushes 32 CTAs; 0.479 and 0.477 in a second launch), 0.476 at 64 push
# CTAs, 0.458 at 16; the shared expert between the dispatch's push and its wait added nothing (0.478)
# (benchmarks/results/train_step_fine_8l_ep4_balanced_spread_wgrad1{,b}_4xh100.json). At EP=2 (2xH100, the same
# day) neutral: 0.516 against 0.515, exposed EP 40 against 55 ms (..._ep2_balanced_spread_wgrad2_2xh100.json).
# Not measured with top-k below ONCE_PER_RANK_MIN_TOPK, host planning or chunks, so auto leaves it off there.

# GEMM SMs left free per CTA of the EP NCCL communicator (``overlap.ep_comm_ctas``): NCCL held to 4 CTAs beside a
# grouped GEMM carved out by 8 SMs hid the whole all-to-all, either launch order (2xH200 NV18, 2026-11-22/23;
# README "What overlaps on Hopper").
EP_NCCL_SMS_PER_CTA = 2
# The same for the data-parallel communicators (``overlap.dp_comm_ctas``): on the slow fabric NCCL at 2 CTAs
# beside GEMMs 8 SMs short hid most of the gradient traffic (2xH200, 2026-11-22,
# benchmarks/results/dp_overlap_2xh200_slow_ctas_pairs.json).
DP_NCCL_SMS_PER_CTA = 4
# The most SMs ``auto`` takes from a GEMM for NCCL beside it: 32 already cost a full-chip grouped GEMM about 25%
# (2xH200, 2026-11-22/23; README "What overlaps on Hopper").
MAX_AUTO_CARVEOUT_SMS = 32

# An SM push CTA's bytes per ms, 64 KiB a program's step (kernels/push_rows.IN_FLIGHT_BYTES): 12.8-13.9 GB/s per CTA
# at 4-16 CTAs into the peer over NVLink (2xH100, 2026-11-28, `moe_layer.py --carveout-probe`,
# moe_layer_2xh100_nvlink_fine_push_64k.json; 9.1-10.4 with 16 KiB, as 2xH200 measured on 2026-11-23).
# `benchmarks/moe_layer.py --carveout-probe` measures it on the GPU in hand.
PUSH_BYTES_PER_CTA_MS = 13.0e6
# The grouped GEMMs' forward rate: 690-720 TFLOP/s on the mixtral and fine shapes, 550 on hidden 2048 / ffn 1024
# (1xH200, moe_layer_1xh200_ep1.json, 2026-11-24).
GROUPED_GEMM_FLOPS_PER_MS = 6.0e11
# More push CTAs than this already move rows at NVLink speed (a 64 MiB push: 0.20 ms at 32 CTAs, 0.19 ms at 132;
# 2xH200, 2026-11-23, benchmarks/results/sync_free_probe_2xh200.json).
MAX_PUSH_CTAS = 32


def auto_push_sms(rows: int, hidden: int, ffn: int, chunks: int, element_size: int) -> int:
    """SMs the grouped GEMMs leave free for the pushes beside them, as many as the pushes' CTAs: enough for a
    chunk's rows (the push moves the local ones through the region too), one chunk each way (the next dispatch,
    the previous combine), to move in one chunk's forward GEMM time (6 x rows x hidden x ffn flops), for rows
    spread evenly over the chunks."""
    chunk_rows = rows / chunks
    moved_bytes = 2 * chunk_rows * hidden * element_size
    gemm_ms = 6 * chunk_rows * hidden * ffn / GROUPED_GEMM_FLOPS_PER_MS
    return max(1, min(MAX_PUSH_CTAS, math.ceil(moved_bytes / (gemm_ms * PUSH_BYTES_PER_CTA_MS))))


# ``train.fp8_wgrad: auto``: where the experts' weight gradients run in FP8 (kernels/fp8_wgrad.py): the rowwise
# recipe, experts at least FP8_WGRAD_MIN_DIM wide in both dimensions (hidden and expert ffn), at least
# FP8_WGRAD_MIN_ROWS rows per expert into each read-modify-write of main_grad (balanced routing; N micro-batches'
# with train.expert_wgrad_micro_batches=N). The FP8 GEMM grows with rows x M x N, quantizing its operands with
# rows x (M + N), the read-modify-write not at all. One H100, 2026-11-27, kernel alone then quantization, ms
# (step_kernels_fp8_wgrad_rows_1xh100.json): Mixtral fc1 at 1,024 rows 5.35 + 0.88 against bf16's 4.70, at 4,096
# rows 8.71 + 3.40 against 14.89; the fine-grained fc1 (2,048 x 2,048) at 4,096 rows 2.40 + 3.43 against 3.98. The
# Mixtral-like bench model (1,024 rows per expert a micro-batch, in pairs: 2,048), two launches
# (train_step_fp8_wgrad_*mixtral_2l*):
# rowwise 0.690 / 0.687 MFU with the FP8 wgrad, 0.672 / 0.682 without (bf16 0.606 / 0.612). Blockwise's per-chunk
# scaling waits for each 128-token product (as its GEMM does): 0.587 / 0.593 with, 0.602 / 0.605 without.
FP8_WGRAD_RECIPES = ("rowwise",)
FP8_WGRAD_MIN_DIM = 4096
FP8_WGRAD_MIN_ROWS = 2048

# ``train.fp8_gemm_min_dim: auto``: a forward or input-gradient GEMM runs in FP8 only where its contraction and its
# output are both at least this wide; narrower ones stay bf16. torch's rowwise grouped FP8 GEMM
# (torch._scaled_grouped_mm, torch 2.11) ran the fine-grained experts' fc2 (contraction 1,024 forward, output 1,024
# in the dgrad; 64 experts x 1,024 rows) at half bf16's speed: 0.935 / 0.850 ms against 0.446 / 0.417; at 2,048 x
# 2,048 (their fc1) 0.651 / 0.646 against 0.794 / 0.801, and the Mixtral shapes (4,096 and up) 1.37-1.54x bf16.
# Blockwise (our Triton GEMM) ran that fc2 at 0.564 / 0.469 (1xH100, 2026-11-27, operands quantized outside the
# timing: step_kernels_fp8_blockwise_paired_1xh100.json). Each FP8 GEMM also quantizes its activation once per call.
# Those are torch's exact accumulation, which the dgrad runs; the forward's fast one ran fc2 at 0.323 against bf16's
# 0.428, its dgrad 0.794 exact against 0.395 (1xH200, step_kernels_fp8_rowwise_1xh200.json): slower together still.
FP8_GEMM_MIN_DIM = 2048
# With train.fp8_dgrad_accumulation=fast the input gradients run the forward's fast accumulation, so the narrow
# GEMMs pay in FP8 too: the fine-grained bench model on one H200 (2026-11-28, train_step_fp8_fast_fine_8l_1xh200.json,
# one launch): bf16 0.603 MFU, rowwise exact 0.644, fast at 2,048 0.651, fast with every GEMM in FP8 0.663.
FP8_GEMM_MIN_DIM_FAST = 0
# ``train.fp8_dgrad_accumulation: auto`` is fast with rowwise: the fine-grained model above +3.0% over exact, the
# Mixtral-like one +2.8% (0.819 -> 0.842 MFU, train_step_fp8_fast_mixtral_2l_1xh200.json); configs/small_gpu.yaml
# over 1,000 steps of real text at two seeds within issue 39's bound of bf16 (fp8_fast_convergence_1xh200.json:
# training-loss gaps 0.027 / 0.020 against a bound of 0.056, validation 0.002 / 0.006 against 0.117); the
# accumulation's own error 0.0015 (contraction 1,024) to 0.0049 (28,672) normwise beside quantization's 0.037
# (fp8_accumulation_1xh200.json). All on one H200, 2026-11-28. Transformer Engine keeps the dgrad exact; torchao's
# rowwise FP8 grouped GEMM (torchtitan's MoE FP8) runs all three GEMMs fast.
