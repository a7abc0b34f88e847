"""Routing balance on CPU: a scaled-down configs/gpu2_fine.yaml (the same family: sigmoid or softmax router, 64
experts top-8, a shared expert, real text; or configs/gpu2_mixtral.yaml's, 8 experts top-2, for variants mixtral_*)
trained for N steps through the Trainer (the same step as `moe-overlap train`: the routers' bias update included),
recording per step and MoE layer each expert's load as a share of the layer's mean (lowest and highest), for several
routing settings side by side. Every variant starts from PROBE_ROUTING (what both families shipped on 2026-11-26), so
a name keeps its meaning when the shipped configs change.

    python benchmarks/routing_probe.py --steps 80 --jobs 2 --json benchmarks/results/routing_probe_cpu.json
    python benchmarks/routing_probe.py --variants bias1e-3,aux1e-2_softmax --steps 30
    python benchmarks/routing_probe.py --at-init 2048:0.02,2048:0.002 --json benchmarks/results/routing_at_init_cpu.json

Each variant runs in its own process on one thread (``--jobs`` at a time). A variant is config overrides on top of
the probe's model, plus optionally a factor on the routers' initial weights (``router_init_scale``). Per variant the
JSON holds every step's loss and per-layer lowest and highest share, and a summary: the first step from which no
expert of any layer stays below ``--min-share`` of its layer's mean until the end ("balanced_from"), the lowest share
over the steps from ``--from-step`` on, the steps with a dead expert (no token) and the last step's loss.
``--at-init`` trains nothing: it routes one sequence through fresh models of the given hidden size, init std and
optionally the embedding's init std (:func:`routing_at_init`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import run_header, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BASE_CONFIG = ROOT / "configs" / "gpu2_fine.yaml"

# gpu2_fine's family at CPU size: 4 layers of hidden 256, 64 experts top-8 with a shared expert, seq 256, 4
# micro-batches of one sequence per step; its routing, learning-rate schedule and z-loss as shipped.
PROBE_MODEL = [
    "model.num_layers=4", "model.hidden_size=256", "model.ffn_hidden_size=512", "model.num_attention_heads=4",
    "model.num_query_groups=2", "model.seq_length=256", "model.moe_ffn_hidden_size=128",
    "model.moe_shared_expert_intermediate_size=128", "parallel.expert_model_parallel_size=1",
    "overlap.overlap_grad_sync=false", "overlap.overlap_param_sync=false", "train.device=cpu", "train.precision=fp32",
    "train.moe_cuda_graph=false", "train.use_distributed_optimizer=false", "train.micro_batch_size=1",
    "train.global_batch_size=4", "train.eval_interval=0", "checkpoint.save_final=false",
]

# The routing every variant starts from: both families' configs on 2026-11-26 (sigmoid scores, the expert bias at
# rate 1e-3, no aux loss, z-loss 1e-3, the shared init std).
PROBE_ROUTING = ["model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
                 "model.moe_router_bias_update_rate=1e-3", "model.moe_aux_loss_coeff=0.0",
                 "model.moe_z_loss_coeff=1e-3", "model.embedding_init_std=null"]
BIAS_OFF = "model.moe_router_enable_expert_bias=false"
# Variants with this suffix route on centered inputs (CenteredInputs): a probe-only experiment, not a model feature.
CENTERED = "+centered"
SOFTMAX = "model.moe_router_score_function=softmax"


def _shipped(*extra: str, aux: str = "1e-2") -> tuple[list[str], float]:
    """The routing configs/gpu*_fine.yaml shipped on 2026-11-27 before softmax (embedding std 1.0, aux loss ``aux``,
    bias rate 1e-2), plus ``extra``."""
    return [f"model.moe_aux_loss_coeff={aux}", "model.moe_router_bias_update_rate=1e-2", "model.embedding_init_std=1.0",
            *extra], 1.0


# name -> (overrides, factor on the routers' initial weights)
VARIANTS: dict[str, tuple[list[str], float]] = {
    "bias1e-3": ([], 1.0),
    "bias1e-2": (["model.moe_router_bias_update_rate=1e-2"], 1.0),
    "aux1e-2_softmax": ([SOFTMAX, BIAS_OFF, "model.moe_aux_loss_coeff=1e-2"], 1.0),
    "aux1e-2_sigmoid": ([BIAS_OFF, "model.moe_aux_loss_coeff=1e-2"], 1.0),
    "aux1e-2+bias1e-3": (["model.moe_aux_loss_coeff=1e-2"], 1.0),
    "seqaux1e-4+bias1e-3": (["model.moe_router_load_balancing_type=seq_aux_loss", "model.moe_aux_loss_coeff=1e-4"],
                            1.0),
    "bias1e-3_router_std/10": ([], 0.1),
    "bias1e-2_router_std/10": (["model.moe_router_bias_update_rate=1e-2"], 0.1),
    "bias1e-3_init_std0.006": (["model.init_method_std=0.006"], 1.0),
    "bias1e-3_lr1e-4": (["train.lr=1e-4", "train.min_lr=1e-5"], 1.0),
    "bias1e-3_init_std0.005": (["model.init_method_std=0.005"], 1.0),
    "aux1e-2+bias1e-3_init_std0.005": (["model.moe_aux_loss_coeff=1e-2", "model.init_method_std=0.005"], 1.0),
    "aux1e-1+bias1e-3": (["model.moe_aux_loss_coeff=1e-1"], 1.0),
    "aux1e-2+bias3e-3": (["model.moe_aux_loss_coeff=1e-2", "model.moe_router_bias_update_rate=3e-3"], 1.0),
    # the token embedding alone initialised larger (model.embedding_init_std; the other weights at 0.02)
    "bias1e-3_embed_std1.0": (["model.embedding_init_std=1.0"], 1.0),
    "bias1e-3_embed_std0.2": (["model.embedding_init_std=0.2"], 1.0),
    "aux1e-2+bias1e-3_embed_std1.0": (["model.moe_aux_loss_coeff=1e-2", "model.embedding_init_std=1.0"], 1.0),
    "bias1e-2_embed_std1.0": (["model.moe_router_bias_update_rate=1e-2", "model.embedding_init_std=1.0"], 1.0),
    "bias3e-2_embed_std1.0": (["model.moe_router_bias_update_rate=3e-2", "model.embedding_init_std=1.0"], 1.0),
    "aux1e-2+bias1e-2_embed_std1.0": (["model.moe_aux_loss_coeff=1e-2", "model.moe_router_bias_update_rate=1e-2",
                                       "model.embedding_init_std=1.0"], 1.0),
    "bias1e-2_embed_std1.0_router_std/10": (["model.moe_router_bias_update_rate=1e-2",
                                             "model.embedding_init_std=1.0"], 0.1),
    "aux1e-2+bias1e-2": (["model.moe_aux_loss_coeff=1e-2", "model.moe_router_bias_update_rate=1e-2"], 1.0),
    "aux1e-2+bias1e-2_embed_std0.5": (["model.moe_aux_loss_coeff=1e-2", "model.moe_router_bias_update_rate=1e-2",
                                       "model.embedding_init_std=0.5"], 1.0),
    # issue 41: on top of the shipped combination (embedding std 1.0, aux 1e-2, bias rate 1e-2; the baseline is
    # aux1e-2+bias1e-2_embed_std1.0), what keeps every expert above 25% of the mean from step 50 on
    "shipped_warmup50": _shipped("train.lr_warmup_steps=50"),
    "shipped_warmup100": _shipped("train.lr_warmup_steps=100"),
    "shipped_qk_layernorm": _shipped("model.qk_layernorm=true"),
    "shipped_aux3e-2": _shipped(aux="3e-2"),
    "shipped_aux1e-1": _shipped(aux="1e-1"),
    "shipped_seqaux1e-2": _shipped("model.moe_router_load_balancing_type=seq_aux_loss"),
    "shipped_lr1e-4": _shipped("train.lr=1.0e-4"),
    # the router z-loss (ST-MoE) shrinks every logit, the part common to all tokens with it
    "shipped_z1e-3": _shipped("model.moe_z_loss_coeff=1e-3"),
    "shipped_z1e-2": _shipped("model.moe_z_loss_coeff=1e-2"),
    "shipped_bias2e-2": ([*_shipped()[0], "model.moe_router_bias_update_rate=2e-2"], 1.0),
    # softmax scores do not saturate the way a sigmoid does when one direction dominates every token's input.
    # OLMoE's recipe (64 experts top-8 too: softmax, aux 1e-2, z 1e-3, no bias), then stronger aux losses; on the
    # embedding at std 1.0
    **{f"softmax_aux{coeff}_embed1.0": ([SOFTMAX, BIAS_OFF, f"model.moe_aux_loss_coeff={coeff}",
                                         "model.embedding_init_std=1.0"], 1.0)
       for coeff in ("1e-2", "5e-2", "1e-1", "2e-1", "3e-1")},
    # the Mixtral-like family (configs/gpu2_mixtral.yaml at CPU size: 8 experts top-2, no shared expert): as shipped
    # on 2026-11-26 (PROBE_ROUTING), then the fine family's best
    "mixtral_shipped": ([], 1.0),
    "mixtral_softmax_aux1e-1_embed1.0": ([SOFTMAX, BIAS_OFF, "model.moe_aux_loss_coeff=1e-1",
                                          "model.embedding_init_std=1.0"], 1.0),
    "mixtral_softmax_aux1e-2_embed1.0": ([SOFTMAX, BIAS_OFF, "model.moe_aux_loss_coeff=1e-2",
                                          "model.embedding_init_std=1.0"], 1.0),
    # the same routing on the shared init std (the embedding at 1.0 slows the first steps' loss)
    "softmax_aux1e-1": ([SOFTMAX, BIAS_OFF, "model.moe_aux_loss_coeff=1e-1", "model.embedding_init_std=null"], 1.0),
    "mixtral_softmax_aux1e-1": ([SOFTMAX, BIAS_OFF, "model.moe_aux_loss_coeff=1e-1"], 1.0),
}
# the shipped routing of each family, and the expert bias alone on the shared std, on centered router inputs
for _name in ("softmax_aux1e-1_embed1.0", "mixtral_shipped", "bias1e-3"):
    VARIANTS[_name + CENTERED] = VARIANTS[_name]
VARIANTS["mixtral_bias1e-2_aux1e-1_embed1.0"] = (  # configs/gpu*_mixtral.yaml's routing since 2026-11-27
    ["model.moe_router_bias_update_rate=1e-2", "model.moe_aux_loss_coeff=1e-1", "model.embedding_init_std=1.0"], 1.0)
VARIANTS["mixtral_bias1e-2_aux1e-1_embed1.0" + CENTERED] = VARIANTS["mixtral_bias1e-2_aux1e-1_embed1.0"]
# The fine examples' routing with the learning rate decayed over 100 steps after a 10-step warm-up (the 4-GPU
# example's schedule) for a run of more steps: the 2-GPU example's dips follow its optimizer steps
# (benchmarks/RESULTS.md, "Quick start on GPUs")
VARIANTS["softmax_aux1e-1_embed1.0_decay100"] = (
    [*VARIANTS["softmax_aux1e-1_embed1.0"][0], "train.lr_decay_steps=100", "train.lr_warmup_steps=10"], 1.0)
# A variant named mixtral_* starts from configs/gpu2_mixtral.yaml with these on top of PROBE_MODEL.
MIXTRAL_CONFIG = ROOT / "configs" / "gpu2_mixtral.yaml"
MIXTRAL_MODEL = ["model.moe_ffn_hidden_size=512", "model.moe_shared_expert_intermediate_size=null"]


def base_of(name: str) -> tuple[Path, list[str]]:
    """The config a variant starts from and the probe model's overrides for it."""
    if name.startswith("mixtral_"):
        return MIXTRAL_CONFIG, PROBE_MODEL + MIXTRAL_MODEL + PROBE_ROUTING
    return BASE_CONFIG, PROBE_MODEL + PROBE_ROUTING


class CenteredInputs:
    """Each router sees its input less the mean of its inputs over the previous step (so no token sees a later
    token's statistics), which takes the direction common to every token out of its logits: a probe-only experiment
    of what would keep the routing token-dependent while that direction grows. One process, no data parallelism."""

    def __init__(self, routers):
        self.state = []
        for router in routers:
            state = {"mean": torch.zeros(router.weight.shape[1]), "sum": torch.zeros(router.weight.shape[1]),
                     "count": 0}
            original = router.logits

            def logits(x_TH, state=state, original=original):
                state["sum"] += x_TH.detach().float().sum(0)
                state["count"] += x_TH.shape[0]
                return original(x_TH - state["mean"].to(x_TH.dtype))

            router.logits = logits
            self.state.append(state)

    def step(self) -> None:
        for state in self.state:
            state["mean"] = state["sum"] / max(state["count"], 1)
            state["sum"].zero_()
            state["count"] = 0


def run_variant(name: str, overrides: list[str], router_init_scale: float, steps: int, data: str) -> dict:
    """One variant, in-process: one thread and the package's warnings off (the dead-expert warnings: the rows count
    them) while it runs, both restored after (a test calls it inside the suite)."""
    threads, package_log = torch.get_num_threads(), logging.getLogger("moe_overlap")
    level = package_log.level
    torch.set_num_threads(1)  # the cores are shared
    package_log.setLevel(logging.ERROR)
    try:
        return _run_variant(name, overrides, router_init_scale, steps, data)
    finally:
        torch.set_num_threads(threads)
        package_log.setLevel(level)


def _run_variant(name: str, overrides: list[str], router_init_scale: float, steps: int, data: str) -> dict:
    from moe_overlap.config import load_config
    from moe_overlap.distributed.mesh import Mesh
    from moe_overlap.training.trainer import Trainer

    out_dir = f"/tmp/routing_probe/{name.replace('/', '_')}"
    base, model = base_of(name)
    cfg = load_config(base, model + [f"data.path={data}", f"train.max_steps={steps}", f"train.output_dir={out_dir}"]
                      + overrides)
    trainer = Trainer(cfg, Mesh.single(), torch.device("cpu"))
    with torch.no_grad():  # fp32 on CPU: the parameter is the optimizer's master weight
        for router in trainer.model.routers().values():
            router.weight.mul_(router_init_scale)
    centered = CenteredInputs(trainer.model.routers().values()) if name.endswith(CENTERED) else None
    rows, start = [], time.time()
    for _ in range(steps):
        metrics = trainer.train_step()
        if centered is not None:
            centered.step()
        layers = sorted(metrics["tokens_per_expert"], key=int)
        shares = {layer: _shares(metrics["tokens_per_expert"][layer]) for layer in layers}
        rows.append({"step": metrics["step"], "loss": round(metrics["loss"], 4),
                     "aux_loss": round(metrics["aux_loss"], 6),
                     "min_share": [round(shares[layer][0], 3) for layer in layers],
                     "max_share": [round(shares[layer][1], 3) for layer in layers],
                     "dead_experts": metrics["moe_dead_experts"]})
    return {"variant": name, "overrides": overrides, "router_init_scale": router_init_scale,
            "seconds": round(time.time() - start, 1), "steps": rows}


def routing_at_init(hidden: int, init_std: float, layers: int = 6, seq: int = 512,
                    embedding_std: float | None = None) -> dict:
    """One forward of a freshly initialised model of gpu2_fine's family (64 experts top-8, hidden ``hidden``,
    ``layers`` layers, small experts; the embedding's init std ``embedding_std``, None: ``init_std``) on ``seq``
    tokens of the corpus: per MoE layer, how alike the router's inputs are (mean cosine to their mean), the spread
    over experts of the token-independent logit (the logits' mean over tokens) against the spread of the rest, and
    the load's highest share of the mean and dead experts."""
    import numpy as np

    from moe_overlap.config import load_config
    from moe_overlap.distributed.mesh import Mesh
    from moe_overlap.models.mixtral import build_model

    torch.set_num_threads(1)
    cfg = load_config(BASE_CONFIG, [f"model.num_layers={layers}", f"model.hidden_size={hidden}",
                                    "model.moe_ffn_hidden_size=128", "model.moe_shared_expert_intermediate_size=128",
                                    f"model.seq_length={seq}", "parallel.expert_model_parallel_size=1",
                                    f"model.init_method_std={init_std}",
                                    f"model.embedding_init_std={'null' if embedding_std is None else embedding_std}"])
    model = build_model(cfg.model, Mesh.single(), "cpu", torch.float32, seed=1234)
    tokens = np.memmap(ROOT / "data" / "stdlib" / "stdlib.bin", dtype=np.uint16, mode="r")
    ids_BS = torch.from_numpy(np.array(tokens[100_000:100_000 + seq], dtype=np.int64)).view(1, -1)
    rows = {}

    def record(index):
        def hook(router, args, routing):
            x_TH = args[0]
            logits_TE = router.logits(x_TH)
            common_E = logits_TE.mean(0)
            counts_E = torch.bincount(routing.experts_TK.flatten(), minlength=router.num_experts).float()
            cosine = F.cosine_similarity(x_TH, x_TH.mean(0, keepdim=True)).mean()
            rows[index] = {"cos_to_mean": round(float(cosine), 3),
                           "common_over_token_logit_std": round(float(common_E.std() / (logits_TE - common_E).std()),
                                                                2),
                           "max_share": round(float(counts_E.max() / counts_E.mean()), 2),
                           "dead_experts": int((counts_E == 0).sum())}
        return hook

    for index, router in model.routers().items():
        router.register_forward_hook(record(index))
    with torch.no_grad():
        model(ids_BS, ids_BS)
    return {"hidden": hidden, "init_method_std": init_std, "embedding_init_std": embedding_std,
            "layers": [rows[i] for i in sorted(rows)]}


def _shares(counts: list[int]) -> tuple[float, float]:
    mean = sum(counts) / len(counts)
    return min(counts) / mean, max(counts) / mean


def summarize(run: dict, from_step: int, min_share: float) -> dict:
    steps = run["steps"]
    lowest = [min(row["min_share"]) for row in steps]
    balanced_from = None
    for row, low in zip(reversed(steps), reversed(lowest)):
        if low < min_share:
            break
        balanced_from = row["step"]
    late = [(low, row) for low, row in zip(lowest, steps) if row["step"] >= from_step]
    worst, worst_row = min(late, key=lambda item: item[0]) if late else (None, None)
    return {"variant": run["variant"], "balanced_from": balanced_from,
            f"min_share_from_{from_step}": None if worst is None else round(worst, 3),
            "worst_step": None if worst_row is None else worst_row["step"],
            f"max_share_from_{from_step}": (None if not late else round(max(max(row["max_share"]) for _, row in late),
                                                                         2)),
            "steps_with_dead_experts": sum(1 for row in steps if row["dead_experts"]),
            "final_loss": steps[-1]["loss"], "seconds": run["seconds"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--jobs", type=int, default=2, help="variants run at a time, one process and thread each")
    parser.add_argument("--data", default=str(ROOT / "data" / "stdlib" / "stdlib.bin"))
    parser.add_argument("--from-step", type=int, default=50, help="the summary's lowest share covers these steps")
    parser.add_argument("--min-share", type=float, default=0.25)
    parser.add_argument("--json", default=None)
    parser.add_argument("--at-init", default=None, metavar="HIDDEN:STD[:EMBED_STD],...",
                        help="instead of training: the routing of fresh models (e.g. 2048:0.02,2048:0.02:1.0)")
    args = parser.parse_args(argv)
    if args.at_init:
        rows = [routing_at_init(int(hidden), float(std), embedding_std=float(embed[0]) if embed else None)
                for hidden, std, *embed in (item.split(":") for item in args.at_init.split(","))]
        for row in rows:
            print(row["hidden"], row["init_method_std"], row["embedding_init_std"], *row["layers"], sep="\n  ")
        write_json(args.json, run_header(1), rows)
        return 0
    names = args.variants.split(",")
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(run_variant, name, *VARIANTS[name], args.steps, args.data): name for name in names}
        done = {}
        for future in concurrent.futures.as_completed(futures):  # each variant's summary as it finishes
            done[futures[future]] = future.result()
            print(summarize(done[futures[future]], args.from_step, args.min_share), flush=True)
    runs = [done[name] for name in names]
    summaries = [summarize(run, args.from_step, args.min_share) for run in runs]
    columns = list(summaries[0])
    print(" | ".join(columns))
    for summary in summaries:
        print(" | ".join(str(summary[column]) for column in columns))
    header = dict(run_header(1), probe_model=PROBE_MODEL, base_config=str(BASE_CONFIG.relative_to(ROOT)),
                  mixtral_base=[str(MIXTRAL_CONFIG.relative_to(ROOT)), *MIXTRAL_MODEL],
                  from_step=args.from_step, min_share=args.min_share, summary=summaries)
    write_json(args.json, header, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
