"""Probe: does an SM push (Triton stores into the peer's symmetric memory, a limited number of CTAs) overlap a
grouped expert GEMM (the fine shape's forward) when the GEMM leaves SMs free (torch._C._set_sm_carveout_experimental)?
Variants timed round-robin, medians, 2 ranks pushing to each other.

    torchrun --standalone --nproc-per-node 2 benchmarks/sm_push_beside_gemm.py   (writes $OUT/carveout_probe_2xh200.json)

Result on 2xH200 (results/carveout_probe_2xh200.json): the carve-out is honoured (GEMM 3.86 ms, 4.14 with 16 SMs
held back, 4.60 with 32), but nothing overlaps: a 32-CTA push (0.90 ms alone) beside the full GEMM gives 4.76 ms,
beside the 32-SM carve-out 5.63 ms -- worse than back to back.
"""
import json, os, statistics
import torch, torch.distributed as dist
import triton, triton.language as tl
rank = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(rank); dev = torch.device("cuda", rank)
dist.init_process_group("nccl", device_id=dev)
import torch.distributed._symmetric_memory as symm_mem
if hasattr(symm_mem, "enable_symm_mem_for_group"): symm_mem.enable_symm_mem_for_group(dist.group.WORLD.group_name)
R, H, F, E = 32768, 7168, 2048, 16
x = torch.randn(R, H, device=dev, dtype=torch.bfloat16)
w13 = torch.randn(E, H, 2 * F, device=dev, dtype=torch.bfloat16) * 0.01
w2 = torch.randn(E, F, H, device=dev, dtype=torch.bfloat16) * 0.01
offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * (R // E)
rows = R // 2  # the remote half
buf = symm_mem.empty(rows * H, dtype=torch.bfloat16, device=dev)
hdl = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
assert not getattr(hdl, "multicast_ptr", 0)
ptrs = torch.tensor(list(hdl.buffer_ptrs), dtype=torch.int64, device=dev)
n = torch.tensor([rows], device=dev)

@triton.jit
def push(src_ptr, ptrs_ptr, peer, n_ptr, H: tl.constexpr, BLOCK: tl.constexpr, CTAS: tl.constexpr):
    n = tl.load(n_ptr)
    dst = tl.load(ptrs_ptr + peer).to(tl.pointer_type(tl.bfloat16))
    cols = tl.arange(0, BLOCK)
    for row in range(tl.program_id(0), n, CTAS):
        for c in range(0, H, BLOCK):
            m = c + cols < H
            v = tl.load(src_ptr + row.to(tl.int64) * H + c + cols, mask=m)
            tl.store(dst + row.to(tl.int64) * H + c + cols, v, mask=m)

side = torch.cuda.Stream()
def gemm(carve):
    torch._C._set_sm_carveout_experimental(carve)
    h = torch._grouped_mm(x, w13, offs=offs)
    torch._grouped_mm(h[:, :F], w2, offs=offs)
    torch._C._set_sm_carveout_experimental(None)
def pushk(ctas):
    push[(ctas,)](x, ptrs, 1 - rank, n, H=H, BLOCK=4096, CTAS=ctas)
def both(carve, ctas):
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        pushk(ctas)
    gemm(carve)
    torch.cuda.current_stream().wait_stream(side)
variants = {"gemm_c0": lambda: gemm(0), "gemm_c16": lambda: gemm(16), "gemm_c32": lambda: gemm(32),
            "push_16": lambda: pushk(16), "push_32": lambda: pushk(32), "push_132": lambda: pushk(132),
            "both_c0_p32": lambda: both(0, 32), "both_c16_p16": lambda: both(16, 16), "both_c32_p32": lambda: both(32, 32)}
samples = {k: [] for k in variants}
for fn in variants.values():
    fn(); fn()
torch.cuda.synchronize()
for _ in range(12):
    for k, fn in variants.items():
        dist.barrier(); torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize()
        samples[k].append(s.elapsed_time(e))
out = {k: round(statistics.median(v), 4) for k, v in samples.items()}
out["torch"] = torch.__version__
if rank == 0:
    print(json.dumps(out, indent=1))
    json.dump(out, open(os.path.join(os.environ["OUT"], "carveout_probe_2xh200.json"), "w"), indent=1)
dist.barrier(); torch.cuda.synchronize()
os._exit(0)  # skip the slow teardown
