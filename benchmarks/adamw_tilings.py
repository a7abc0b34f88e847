"""Whether every tiling of the optimizer step that leaves the FP8 copies' maxima (kernels/adamw.py, train.fp8_param)
writes the master and moments the flat step writes, bit for bit, and the maxima torch takes of the new master; one
CUDA GPU, one JSON row per weight shape and tiling:

    PYTHONPATH=. python benchmarks/adamw_tilings.py OUT.json

(Its first run found ptxas fusing multiply-adds by the tiles' layout: the fast one-row tilings 1 ulp off; the step's
arithmetic now writes every multiply-add out. Times: benchmarks/step_kernels.py --sections fp8_param.)
"""

import json
import sys

import torch

from moe_overlap.kernels.adamw import AdamWHyper, WeightMaxima, adamw_maxima_triton, adamw_update_triton

SHAPES = [(8, 1024, 4096), (3, 333, 1041), (64, 2048, 2048), (64, 1024, 2048)]  # Mixtral-like, odd, the fine fc1/fc2
TILINGS = [((1, 1024, 32), 8, 4), ((1, 1024, 16), 8, 4), ((1, 1024, 64), 8, 4), ((1, 1024, 32), 8, 8),
           ((1, 512, 64), 4, 8), ((2, 512, 64), 4, 8), ((4, 1024, 4), 8, 4), ((4, 1024, 4), 4, 8),
           ((1, 1024, 32), 4, 8), ((2, 1024, 32), 8, 4),
           ((1, 2048, 32), 8, 4)]  # (BLOCK_M, BLOCK_K, SPAN_M), warps, per SM
NAMES = ("master", "grad", "exp_avg", "exp_avg_sq")


def state(shape: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(shape, generator=g, device="cuda"), torch.randn(shape, generator=g, device="cuda"),
            torch.randn(shape, generator=g, device="cuda") * 0.1, torch.rand(shape, generator=g, device="cuda") * 0.01]


def main(path: str) -> None:
    hyper = AdamWHyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    control = torch.tensor([0.5, 3.0, 1.0], device="cuda")
    out = []
    for shape in SHAPES:
        flat = state(shape)
        adamw_update_triton(*flat, None, control, hyper)
        M, K = shape[-2:]
        B = flat[0].numel() // (M * K)
        for blocks, warps, per_sm in TILINGS:
            tiled = state(shape)
            maxima = WeightMaxima(torch.zeros(B * M, device="cuda"), torch.zeros(B * K, device="cuda"), torch.bfloat16)
            adamw_maxima_triton(*tiled, control, hyper, maxima, blocks, warps, per_sm)
            row = {"shape": shape, "blocks": blocks, "warps": warps, "per_sm": per_sm}
            for name, t, f in zip(NAMES, tiled, flat):
                row[name] = int((t != f).sum())  # elements that differ from the flat step's
                if row[name]:
                    row[name + "_max_abs_difference"] = float((t - f).abs().max())
            weights = tiled[0].view(B, M, K).to(torch.bfloat16).float().abs()
            row["maxima_exact"] = bool(torch.equal(maxima.rows_BM, weights.amax(-1).reshape(-1))
                                       and torch.equal(maxima.columns_BK, weights.amax(-2).reshape(-1)))
            print(json.dumps(row), flush=True)
            out.append(row)
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": out}, open(path, "w"),
              indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
