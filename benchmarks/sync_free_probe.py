"""Probe behind the sync-free dispatch: torch._grouped_mm on a buffer longer than its offsets (rows past the last
offset are skipped, NaN there reaches no output or weight gradient, no extra time); Triton stores into a peer's
symmetric memory (bandwidth by CTA count against the copy engine); an NCCL all-gather captured in a CUDA graph.

    torchrun --standalone --nproc-per-node 2 benchmarks/sync_free_probe.py   (writes $OUT/probe.json)

Result on 2xH200: results/sync_free_probe_2xh200.json (written before the final destroy_process_group, which
hung there and was ended by the launch's timeout).
"""
import json, os, sys, time
import torch, torch.distributed as dist
import triton, triton.language as tl
rank = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(rank); dev = torch.device("cuda", rank)
dist.init_process_group("nccl")
out = {}
g = torch.Generator(device=dev).manual_seed(0)
# 1. grouped_mm with offs[-1] < M
M, H, F, E = 4096, 512, 256, 3
x = torch.randn(M, H, device=dev, dtype=torch.bfloat16, generator=g); x[3000:] = float("nan")
w = torch.randn(E, H, F, device=dev, dtype=torch.bfloat16, generator=g)
offs = torch.tensor([1000, 2000, 3000], device=dev, dtype=torch.int32)
y = torch._grouped_mm(x, w, offs=offs)
ref = torch.cat([x[i*1000:(i+1)*1000].float() @ w[i].float() for i in range(3)])
out["fwd_err"] = ((y[:3000].float() - ref).norm() / ref.norm()).item()
out["fwd_tail_nan_frac"] = y[3000:].isnan().float().mean().item()
gy = torch.randn(M, F, device=dev, dtype=torch.bfloat16, generator=g); gy[3000:] = float("nan")
dw = torch._grouped_mm(x.t(), gy, offs=offs)
refw = torch.stack([x[i*1000:(i+1)*1000].float().t() @ gy[i*1000:(i+1)*1000].float() for i in range(3)])
out["wgrad_err"] = ((dw.float() - refw).norm() / refw.norm()).item()
out["wgrad_nan"] = dw.isnan().any().item()
dx = torch._grouped_mm(gy, w.transpose(-2, -1), offs=offs)
refx = torch.cat([gy[i*1000:(i+1)*1000].float() @ w[i].float().t() for i in range(3)])
out["dgrad_err"] = ((dx[:3000].float() - refx).norm() / refx.norm()).item()
# timing: grouped_mm on a buffer twice the rows it covers vs exact
M2, H2, F2, E2 = 16384, 4096, 28672, 4
xb = torch.randn(M2, H2, device=dev, dtype=torch.bfloat16); wb = torch.randn(E2, H2, F2, device=dev, dtype=torch.bfloat16)*0.01
offs_half = torch.tensor([2048, 4096, 6144, 8192], device=dev, dtype=torch.int32)
def tm(fn, n=10):
    fn(); torch.cuda.synchronize(); s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n): fn()
    e.record(); e.synchronize(); return s.elapsed_time(e) / n
out["gmm_exact_ms"] = tm(lambda: torch._grouped_mm(xb[:8192], wb, offs=offs_half))
out["gmm_padded_ms"] = tm(lambda: torch._grouped_mm(xb, wb, offs=offs_half))
del xb, wb
# 2. Triton stores into a peer's symmetric buffer
import torch.distributed._symmetric_memory as symm_mem
if hasattr(symm_mem, "enable_symm_mem_for_group"): symm_mem.enable_symm_mem_for_group(dist.group.WORLD.group_name)
R, HH = 16384, 4096
buf = symm_mem.empty(R * HH, dtype=torch.bfloat16, device=dev)
hdl = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
out["multicast_ptr"] = int(getattr(hdl, "multicast_ptr", 0))
ptrs = torch.tensor(list(hdl.buffer_ptrs), dtype=torch.int64, device=dev)
out["has_buffer_ptrs_dev"] = hasattr(hdl, "buffer_ptrs_dev")

@triton.jit
def push_rows(src_ptr, ptrs_ptr, peer, n_ptr, H: tl.constexpr, BLOCK: tl.constexpr, CTAS: tl.constexpr):
    n = tl.load(n_ptr)
    dst = tl.load(ptrs_ptr + peer).to(tl.pointer_type(tl.bfloat16))
    cols = tl.arange(0, BLOCK)
    for row in range(tl.program_id(0), n, CTAS):
        for c in range(0, H, BLOCK):
            v = tl.load(src_ptr + row.to(tl.int64) * H + c + cols)
            tl.store(dst + row.to(tl.int64) * H + c + cols, v)

src = torch.randn(R, HH, device=dev, dtype=torch.bfloat16) + rank
n = torch.tensor([8192], device=dev, dtype=torch.int64)  # 64 MiB
peer = 1 - rank
buf.zero_(); torch.cuda.synchronize(); dist.barrier()
push_rows[(132,)](src, ptrs, peer, n, H=HH, BLOCK=1024, CTAS=132)
torch.cuda.synchronize(); dist.barrier()
expect = torch.randn(1, device=dev)  # placeholder
# peer wrote its src+peer into my buf: check mine equals peer's src (regenerate with same RNG? compare sums via allgather)
mine_sum = buf.view(R, HH)[:8192].float().sum()
src_sum = src[:8192].float().sum()
sums = [torch.zeros(2, device=dev) for _ in range(2)]
dist.all_gather(sums, torch.stack([mine_sum, src_sum]))
out["peer_store_ok"] = bool(torch.isclose(sums[rank][0], sums[peer][1], rtol=1e-3).item())
out["tail_untouched"] = bool((buf.view(R, HH)[8192:] == 0).all().item())
for ctas in (16, 32, 66, 132, 264):
    for block in (1024, 4096):
        dist.barrier()
        out[f"push64MiB_ctas{ctas}_b{block}_ms"] = tm(lambda: push_rows[(ctas,)](src, ptrs, peer, n, H=HH, BLOCK=block, CTAS=ctas))
# copy engine reference
dstv = hdl.get_buffer(peer, (8192, HH), torch.bfloat16, 0)
dist.barrier()
out["copy_engine_64MiB_ms"] = tm(lambda: dstv.copy_(src[:8192], non_blocking=True))
# 3. NCCL all_gather in a graph
try:
    cnt = torch.arange(8, device=dev)
    res = torch.empty(16, device=dev, dtype=cnt.dtype)
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        dist.all_gather_into_tensor(res, cnt)
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_gather_into_tensor(res, cnt * 2)
    res.zero_(); graph.replay(); torch.cuda.synchronize()
    out["nccl_allgather_graph"] = res.tolist()
except Exception as err:
    out["nccl_allgather_graph"] = f"failed: {err!r}"[:300]
torch.cuda.synchronize(); dist.barrier()
if rank == 0:
    print(json.dumps(out, indent=1))
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe.json"), "w"), indent=1)
dist.destroy_process_group()
