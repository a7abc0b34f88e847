"""Host-side cost of one host-planned MoE pipeline layer (copy engine, one chunk) on 2 GPUs: for the mixtral and fine_small
shapes, the wall time of a forward (and forward+backward) from an idle GPU, the time the host takes to return
from it (what it spends issuing work, the one sync included), and a cProfile of 10 back-to-back forwards.

    torchrun --nproc-per-node 2 benchmarks/moe_host_time.py benchmarks/results

writes host_profile_<shape>.txt there (rank 0). CUDA only.
"""
import cProfile, io, os, pstats, sys, time
sys.path.insert(0, os.getcwd())
import torch, torch.distributed as dist
from moe_overlap.config import ModelConfig, OverlapConfig
from moe_overlap.distributed.a2a import TransportSelector
from moe_overlap.distributed.mesh import Mesh, MeshLayout
from moe_overlap.layers.init import init_parameters
from moe_overlap.layers.moe import MoELayer
rank = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(rank)
dist.init_process_group("nccl")
mesh = Mesh.create(MeshLayout(2, ep=2), timeout_s=120)
dev = torch.device("cuda", rank)
out_dir = sys.argv[1]
for name, (T, H, F, E, K) in {"mixtral": (4096, 4096, 14336, 8, 2), "fine_small": (4096, 2048, 1024, 32, 4)}.items():
    cfg = ModelConfig(hidden_size=H, ffn_hidden_size=F, num_moe_experts=E, moe_router_topk=K, moe_aux_loss_coeff=0.0)
    sel = TransportSelector("host", "copy_engine", mesh.ep.group, mesh.ep.ranks, dev, E // 2, 300)
    layer = MoELayer(cfg, OverlapConfig(moe_pipeline=True, moe_planning="host", moe_transport="copy_engine"), mesh.ep,
                     sel, dev, torch.bfloat16)
    init_parameters(layer, seed=1234, std=0.02, num_layers=1)
    x = torch.randn(1, T, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(1, T, H, device=dev, dtype=torch.bfloat16)
    def fwd(): return layer(x)[0]
    for _ in range(5): fwd().backward(g)
    torch.cuda.synchronize(); dist.barrier()
    lines = []
    # wall and host time of forward, of forward+backward
    for label, bwd in (("fwd", False), ("fwdbwd", True)):
        walls, hosts = [], []
        for _ in range(10):
            torch.cuda.synchronize(); dist.barrier()
            t0 = time.perf_counter(); out = fwd()
            if bwd: out.backward(g)
            t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
            hosts.append((t1 - t0) * 1e3); walls.append((t2 - t0) * 1e3)
        lines.append(f"{name} {label}: wall {sorted(walls)[5]:.2f} ms, host returns after {sorted(hosts)[5]:.2f} ms")
    pr = cProfile.Profile()
    torch.cuda.synchronize(); dist.barrier()
    pr.enable()
    for _ in range(10):
        out = fwd()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35); lines.append(s.getvalue())
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45); lines.append(s.getvalue())
    if rank == 0:
        open(os.path.join(out_dir, f"host_profile_{name}.txt"), "w").write("\n".join(lines))
        print(lines[0]); print(lines[1])
    del layer, sel
dist.destroy_process_group()
