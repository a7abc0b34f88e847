"""The training loop: gradient accumulation, AdamW with warmup + decay, evaluation, metrics, checkpoints."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

from moe_overlap.config import Config, ConfigError, TrainConfig, config_yaml, validate_for_world
from moe_overlap.config.defaults import fp8_fast_dgrad, fp8_gemm_min_dim, fp8_param
from moe_overlap.distributed.collectives import all_gather_into, all_reduce_
from moe_overlap.distributed.mesh import Mesh
from moe_overlap.distributed.monitor import RankMonitor
from moe_overlap.distributed.streams import (Event, ExposedComm, HostCopy, check_gemm_sm_carveout,
                                             measuring_exposed_comm, to_device_async)
from moe_overlap.distributed.symm import symmetric_memory_bytes
from moe_overlap.layers.fp8 import Fp8
from moe_overlap.layers.exchange_memory import paged_stash_size
from moe_overlap.layers.moe import host_planned_rerun
from moe_overlap.layers.paged_stash import PagedStash
from moe_overlap.layers.param_info import param_info
from moe_overlap.layers.routing_replay import RoutingReplay, replay_refusal
from moe_overlap.models.flops import flops_per_token
from moe_overlap.models.mixtral import build_model
from moe_overlap.models.pipeline_stages import PipelineStages
from moe_overlap.precision import DTYPES
from moe_overlap.training.checkpoint import (DAMAGED_SUFFIX, check_checkpoint_matches, load_checkpoint,
                                             newest_good_checkpoint, save_checkpoint, step_dir)
from moe_overlap.training.data import BatchSampler, eval_batches, load_data
from moe_overlap.training.dist_optimizer import DistributedOptimizer
from moe_overlap.training.expert_load import DeadExperts, imbalance, micro_batch_imbalance
from moe_overlap.training.hf_checkpoint import load_model_weights
from moe_overlap.training.optimizer import MixedPrecisionAdamW, check_nonfinite, lr_at
from moe_overlap.training.pipeline import Carveouts, PipelineExecutor
from moe_overlap.training.preemption import StopRequests
from moe_overlap.training.profiling import StepProfiler, measured_gemm_tflops
from moe_overlap.training.run_setup import check_resume_setting, dp_gemm_sms, paired_gemm_sms, resolve_by_fabric
from moe_overlap.training.schedules import graph_copies, in_flight
from moe_overlap.training.state_memory import check_state_fits, state_bytes
from moe_overlap.training.streams_memory import naming_streams_on_oom

log = logging.getLogger(__name__)

Optimizer = MixedPrecisionAdamW | DistributedOptimizer  # train.use_distributed_optimizer picks one


class Trainer:
    def __init__(self, cfg: Config, mesh: Mesh, device: torch.device, routing_replay: RoutingReplay | None = None):
        """``routing_replay``: every MoE layer's routing recorded into it, or replayed from it
        (layers/routing_replay.py: a benchmark's reference routed as the run it is the limit of)."""
        validate_for_world(cfg, mesh.world_size, device.type)
        if routing_replay is not None and (refusal := replay_refusal(cfg)) is not None:
            raise ValueError(refusal)  # before a model is built
        resolve_by_fabric(cfg, mesh, device)
        self.cfg, self.mesh, self.device = cfg, mesh, device
        t = cfg.train
        check_gemm_sm_carveout(cfg.overlap.gemm_sm_carveout, device)
        train_tokens, val_tokens = load_data(cfg)  # first: a missing corpus fails before a model is built
        if device.type == "cuda":  # a state that cannot fit fails here, not in an allocation once built
            check_state_fits(mesh.rank, state_bytes(cfg, Mesh.planned(mesh.layout, mesh.rank)),
                             torch.cuda.get_device_properties(device).total_memory)
        torch.manual_seed(t.seed)
        stages = PipelineStages.from_config(cfg)  # with PP, this rank builds only its stages' layers
        self.model = build_model(cfg.model, mesh, device, DTYPES[t.precision], t.seed,
                                 recompute=t.recompute_granularity == "full", overlap=cfg.overlap,
                                 timeout_s=t.distributed_timeout_s, sequence_parallel=cfg.parallel.sequence_parallel,
                                 **stages.model_kwargs(mesh.pp.rank))
        if t.init_from:  # before the optimizer, which takes its master weights from the parameters
            loaded = load_model_weights(self.model, t.init_from)
            if mesh.rank == 0:
                log.info("model weights from %s (train.init_from=%s)", loaded, t.init_from)
        if cfg.model.moe_router_force_load_balancing and mesh.rank == 0:
            log.warning("model.moe_router_force_load_balancing=true: every token's experts are assigned (each expert "
                        "the same load); the model does not learn routing (a benchmark setting)")
        if t.expert_wgrad_micro_batches > 1:
            self.model.group_expert_wgrads(t.expert_wgrad_micro_batches)
        if t.fp8_recipe is not None:  # before the MoE layers' graphs capture them
            self.model.use_fp8(Fp8(recipe=t.fp8_recipe, wgrad=t.fp8_wgrad, min_dim=fp8_gemm_min_dim(t),
                                   fast_dgrad=fp8_fast_dgrad(t)),
                               t.num_layers_at_start_in_bf16, t.num_layers_at_end_in_bf16)
        self.optimizer = (DistributedOptimizer(self.model, mesh, t, cfg.overlap) if t.use_distributed_optimizer
                          else MixedPrecisionAdamW(self.model, mesh, t, cfg.overlap.grad_sync_dtype))
        if fp8_param(t):  # before any FP8 GEMM places a copy
            self.optimizer.hold_fp8_weights()
        o = cfg.overlap  # which of the distributed optimizer's syncs overlap the compute (their GEMMs are carved out)
        self._dp_overlaps = DPOverlaps(t.use_distributed_optimizer and o.overlap_grad_sync,
                                       t.use_distributed_optimizer and o.overlap_param_sync)
        # every micro-batch schedule, PP=1 included (a one-stage pipeline)
        self.pipeline = PipelineExecutor(cfg, mesh, self.model, stages, self.optimizer, device, DTYPES[t.precision])
        if cfg.overlap.moe_compute_only and mesh.rank == 0:
            log.warning("overlap.moe_compute_only: every rank's MoE rows stay in its own memory (a benchmark's "
                        "reference without the exchange's transfers); its learning rate is held at 0 and its loss "
                        "means nothing")
        self._moe_layers = [layer.mlp for layer in self.model.layers.values() if layer.is_moe]
        self._exchange = next((m.transports for m in self._moe_layers if m.transports is not None), None)
        self._stash = self._paged_stash(stages)  # before the graphs capture the MoE layers' stash
        # the MoE layers' GEMMs capture their own carve-out; a set of graphs per micro-batch in flight (paired, or a
        # pipeline stage's 1F1B warm-up; each model chunk's own under interleaved 1F1B), which micro-batch i replays
        # as set i mod n (MoELayer.for_micro_batch)
        streams = self.pipeline.pair_streams
        copies = self._graph_copies(stages, streams is not None) if t.moe_cuda_graph else 1
        self.routing_replay = routing_replay
        if routing_replay is not None:  # before the graphs capture each set's routing slot
            self.model.replay_routing(routing_replay, t.micro_batch_size, copies)
        if t.moe_cuda_graph:  # after the optimizer: it may move the parameters into its buffers
            with naming_streams_on_oom(streams is not None):
                self.model.graph_moe_layers(t.micro_batch_size, copies,
                                            replay_streams=streams.streams if streams else None)
            self.optimizer.zero_grad()  # the capture's warm-up backward passes added into main_grad
        dp = mesh.dp
        self.sampler = BatchSampler(train_tokens, cfg.model.seq_length, t.global_batch_size, t.micro_batch_size,
                                    dp.rank, dp.size, t.seed, mesh.cp.rank, mesh.cp.size)
        self.val_batches = [] if not t.eval_interval else eval_batches(
            val_tokens, cfg.model.seq_length, t.micro_batch_size, t.eval_iters, t.global_batch_size, dp.rank, dp.size,
            mesh.cp.rank, mesh.cp.size)
        self.num_micro_batches = cfg.num_micro_batches(mesh.world_size)
        self.step = 0
        self.saved_step: int | None = None  # the step of the checkpoint last saved or loaded
        self.stopped_by: str | None = None  # why fit stopped before train.max_steps (a signal, the time limit)
        self.tokens_per_micro_batch: dict[int, torch.Tensor] = {}  # layer -> (micro-batches, experts), this rank's
        # The device-planned exchange's receive bound (overlap.moe_expert_rank_capacity_factor): a step in which any
        # rank's rows overflowed it is skipped on the device and run again planned on the host (_run_again); the
        # step queued behind it (fit queues one ahead) ran on the same weights and is skipped too, by this flag
        self._bounded = bounded_exchange(cfg)  # from the config alone: every rank joins the reduction
        # the pipelined exchange counts the bytes it sends (moe_exchange_gib); from the config, as _bounded
        self._counted = (cfg.model.num_moe_experts is not None and bool(cfg.overlap.moe_pipeline)
                         and cfg.parallel.expert_model_parallel_size * cfg.expert_tensor_parallel_size > 1)
        self._rerun_pending = torch.zeros((), dtype=torch.bool, device=device)
        self.is_logger = mesh.rank == 0
        self.dead_experts = DeadExperts(warn=self.is_logger)
        self.flops_per_token = flops_per_token(cfg.model)
        self._last_step_end: Event | None = None  # where the next step's time starts (steps run back to back)
        # the last step's segment runs on this rank, (F | B, micro-batch, segment name): with
        # overlap_moe_expert_parallel_comm, the interleaving (segments are named as the exposed-comm stage labels)
        self.stage_order: list[tuple[str, int, str]] = []

    # ------------------------------------------------------------------------------------------ steps
    def forward_backward(self, step: int) -> torch.Tensor:
        """Accumulate one global batch's gradients through this rank's schedule (training/pipeline.py); returns
        this rank's mean LM and auxiliary losses, (2,) fp64 on the device: nothing here waits for the host."""
        self.model.train()
        # Each micro-batch's loss is a mean over its tokens; dividing by every micro-batch of every
        # data-parallel rank makes the summed gradients those of the global-batch mean.
        loss_scale = 1.0 / (self.num_micro_batches * self.mesh.dp.size)
        if self.routing_replay is not None:
            self.routing_replay.step = step
        result = self.pipeline.run(list(self.sampler.micro_batches(step)), loss_scale, carveouts=self._carveouts())
        self.tokens_per_micro_batch, self.stage_order = result.tokens_per_micro_batch, result.order
        return result.losses

    def _carveouts(self) -> Carveouts:
        """The SMs the step's GEMMs leave free beside the distributed optimizer's overlapped syncs and, paired,
        beside the other micro-batch's exchanges (read from the config at each step)."""
        dp, overlaps = dp_gemm_sms(self.cfg), self._dp_overlaps
        paired = self.cfg.overlap.overlap_moe_expert_parallel_comm
        return Carveouts(dp if overlaps.param_sync else 0, dp if overlaps.grad_sync else 0,
                         paired_gemm_sms(self.cfg, self.mesh) if paired else 0)

    def train_step(self, inspect_grads: Callable[[Optimizer], None] | None = None) -> dict:
        """One optimizer step, its metrics read back; ``inspect_grads`` sees the reduced gradients before the
        update (tests; again for a step run again)."""
        attempt = self.launch_step(inspect_grads)
        metrics = self.finish_step(attempt)
        if metrics.get("moe_rerun_rows"):
            metrics, _ = self._run_again(attempt, metrics, None,
                                         lambda: self.finish_step(self.launch_step(inspect_grads)))
        return metrics

    def _run_again(self, attempt: StepInFlight, metrics: dict, queued: StepInFlight | None,
                   finish: Callable[[], dict]) -> tuple[dict, StepInFlight | None]:
        """After a step (``attempt``, its ``metrics``) whose device-planned exchange overflowed its bound on some
        rank (its update was skipped on the device): the same step again, every MoE layer planned on the host and
        run eagerly (graphs set aside); ``finish`` launches and finishes it. ``queued``, a step launched behind it,
        ran on the same weights and was skipped too (the pending flag): it is launched again after. Returns the
        step's metrics (with the overflow that caused the re-run; its time from the attempt's start, so the wasted
        work counts) and the step now queued."""
        self.step = metrics["step"] - 1
        self._rerun_pending.zero_()  # stream-ordered after the queued step read it
        self._last_step_end = attempt.start
        recompute = self.model.recompute
        self.model.recompute = recompute or self._rerun_recomputes()
        try:
            with host_planned_rerun(self._moe_layers):
                again = finish()
        finally:
            self.model.recompute = recompute
        again.update(moe_overflow_rows=metrics["moe_overflow_rows"], moe_rerun_rows=metrics["moe_rerun_rows"],
                     moe_overflow_reruns=1)
        if self.is_logger:
            o = self.cfg.overlap
            log.info("step %d: %d MoE rows overflowed the device-planned exchange's bound, %d of them past every bound "
                     "(overlap.moe_expert_rank_capacity_factor=%s, moe_overflow_capacity_factor=%s, "
                     "moe_paged_stash_factor=%s); the step ran again planned on the host", metrics["step"],
                     metrics["moe_overflow_rows"], metrics["moe_rerun_rows"], o.moe_expert_rank_capacity_factor,
                     o.moe_overflow_capacity_factor, o.moe_paged_stash_factor)
        return again, None if queued is None else self.launch_step()

    def _graph_copies(self, stages: PipelineStages, on_streams: bool) -> list[tuple[tuple[int, ...], int]]:
        """Each model chunk of this rank, its layers and their graphed copies: its micro-batches in flight
        (schedules.graph_copies); with pairs on two streams an even count, each set with its own regions, so that a
        set's micro-batches i, i + n, ... all run on stream i mod 2, one after another."""
        rank = self.mesh.pp.rank
        actions = self.pipeline.schedule.ranks[rank]
        counts = [graph_copies(actions, chunk) for chunk in range(stages.vpp)]
        return [(stages.layers[stages.stage(rank, chunk)], n + n % 2 if on_streams else n)
                for chunk, n in enumerate(counts)]

    def _paged_stash(self, stages: PipelineStages) -> PagedStash | None:
        """``overlap.moe_paged_stash_factor``: one pool of pages for every device-planned MoE layer call in flight on
        this rank (its schedule's units in flight x the most MoE layers of one of its model chunks), which every MoE
        layer keeps its backward's tensors in; None without the factor or a device-planned exchange."""
        exchange = self._exchange
        if self.cfg.overlap.moe_paged_stash_factor is None or exchange is None or exchange.planning != "device":
            return None
        rank = self.mesh.pp.rank
        calls = in_flight(self.pipeline.schedule.ranks[rank]) * stages.most_moe_layers(rank, self.cfg.model)
        rows, stashes, row_bytes, page_rows = paged_stash_size(self.cfg, calls)
        stash = PagedStash(rows, stashes, row_bytes, self.device, exchange.count_overflow, page_rows)
        for layer in self._moe_layers:
            layer.stash = stash
        if self.mesh.rank == 0:
            log.info("MoE paged stash: %d pages of %d rows x %d bytes (%.2f GiB a rank) for %d layer calls in flight "
                     "(overlap.moe_paged_stash_factor=%g)", stash.pages, stash.page_rows, stash.row_bytes,
                     stash.nbytes / 2**30, calls, self.cfg.overlap.moe_paged_stash_factor)
        return stash

    def _rerun_recomputes(self) -> bool:
        """Whether a step run again recomputes every layer in its backward (train.recompute_granularity=full for
        that step): the attempt's graphs keep its static tensors in their pools, and the re-run's host-planned
        stash is at least the bound that overflowed, so holding it for every layer can run out of memory where the
        attempt fit (configs/gpu4_fine.yaml at 4 sequences a micro-batch on 4xH100, 2026-11-28); recomputed, it holds
        one layer's. Not where recomputation is not implemented: paired micro-batches' stages (pairs on two streams
        run whole), ZB-H1."""
        staged = self.cfg.overlap.overlap_moe_expert_parallel_comm and self.pipeline.pair_streams is None
        return not staged and self.cfg.train.pipeline_schedule != "zb_h1"

    def launch_step(self, inspect_grads: Callable[[Optimizer], None] | None = None) -> StepInFlight:
        """Queue one optimizer step's work; its numbers stay on the device until :meth:`finish_step`, so the
        host can queue the next step while this one runs."""
        start = Event(self.device, timing=True).record() if self._last_step_end is None else self._last_step_end
        # compute_only's experts read rows that never left another rank: learning from them diverges (real-text
        # routing then crashed a GPU run within 4 steps), so its optimizer does the same work at learning rate 0
        lr = 0.0 if self.cfg.overlap.moe_compute_only else lr_at(self.step, self.cfg.train)
        if self._exchange is not None:
            self._exchange.zero_counters()
        if self._stash is not None:  # every page free (an overflowed attempt's backward returned its pages too)
            self._stash.reset()
        with measuring_exposed_comm(self.device) as exposed:
            losses = self.forward_backward(self.step)
            self.optimizer.reduce_grads()
            if inspect_grads is not None:
                inspect_grads(self.optimizer)
            world = self._world_stats()
            skip = None
            if self._bounded:  # the same on every rank: reduced over the world
                skip = self._rerun_pending | (world[1] > 0)
                self._rerun_pending.copy_(skip)
            grad_norm, applied = self.optimizer.step(lr, self.step, skip)
        loads = self._step_expert_load()
        for layer, router in self.model.routers().items():
            router.update_load(loads[layer], applied)
        # One copy to the host of everything the metrics read, queued now: finish_step waits for this step only.
        values = HostCopy(torch.cat([self._dp_mean(losses), grad_norm.view(1).double(), applied.view(1).double(),
                                     self.optimizer.nonfinite_flags(),
                                     *(counts.double() for counts in loads.values()),
                                     self._micro_batch_ep_imbalance(), world]))
        self._last_step_end = Event(self.device, timing=True).record()
        self.step += 1
        return StepInFlight(self.step, lr, values, list(loads), exposed, start, self._last_step_end)

    def finish_step(self, pending: StepInFlight) -> dict:
        """The host's one wait of a step: its losses, norm, expert loads and timings as metrics."""
        values = pending.values.wait().tolist()
        if pending.end is self._last_step_end:  # nothing queued behind it: the next step's time starts at its launch
            self._last_step_end = None
        loss, aux_loss, grad_norm, applied = values[:4]
        nonfinite = values[4:4 + len(self.optimizer.norm_names)]
        experts, layers = self.cfg.model.num_moe_experts or 0, len(pending.moe_layers)  # none: a dense model
        loads = values[4 + len(nonfinite):4 + len(nonfinite) + layers * experts]
        micro_batch_imbalance = values[4 + len(nonfinite) + layers * experts:-5]  # (mean, max) per layer, or none
        overflow_rows, unplaced_rows, peak_bytes, reserved_bytes, exchange_bytes = values[-5:]
        if not applied and not unplaced_rows:  # an overflowed step runs again (train_step, fit)
            check_nonfinite(grad_norm, pending.step - 1, self.cfg.train,
                            [name for name, bad in zip(self.optimizer.norm_names, nonfinite) if bad])
        seconds = pending.start.elapsed_ms(pending.end) / 1e3
        tokens = self.cfg.train.global_batch_size * self.cfg.model.seq_length
        tflops_per_gpu = tokens * self.flops_per_token / seconds / self.mesh.world_size / 1e12
        metrics = {"step": pending.step, "loss": loss, "aux_loss": aux_loss, "lr": pending.lr, "grad_norm": grad_norm,
                   "skipped": not applied, "step_time_s": seconds, "tokens_per_s": tokens / seconds,
                   "tflops_per_gpu": tflops_per_gpu, "mfu": tflops_per_gpu / self.cfg.train.peak_tflops,
                   "exposed_comm_ms": pending.exposed.totals_ms()}
        if self.cfg.overlap.overlap_moe_expert_parallel_comm:
            metrics["exposed_comm_by_stage_ms"] = pending.exposed.by_stage_ms()
        if self.device.type == "cuda":  # symmetric memory is allocated beside torch's allocator: added
            metrics["peak_memory_gib"] = peak_bytes / 2**30  # the most on any rank
            # what the allocator holds, graph pools and its cache included: what a graphed layer's static
            # tensors cost once its backward is captured (the allocated peak sees them as freed then)
            metrics["reserved_memory_gib"] = reserved_bytes / 2**30
            metrics["symmetric_memory_gib"] = symmetric_memory_bytes() / 2**30  # this rank's
        if self._counted:  # the pipelined exchange's transports count what they send
            metrics["moe_exchange_gib"] = exchange_bytes / 2**30
        if self._bounded:  # moe_rerun_rows: rows no bound took (the step runs again, moe_overflow_reruns then 1)
            metrics.update(moe_overflow_rows=int(overflow_rows), moe_rerun_rows=int(unplaced_rows),
                           moe_overflow_reruns=0)
        if pending.moe_layers:
            metrics["tokens_per_expert"] = {str(layer): [int(c) for c in loads[i * experts:(i + 1) * experts]]
                                            for i, layer in enumerate(pending.moe_layers)}
            metrics["ep_imbalance"] = {layer: imbalance(counts, self.mesh.ep.size)
                                       for layer, counts in metrics["tokens_per_expert"].items()}
            metrics["expert_imbalance"] = {layer: imbalance(counts, len(counts))
                                           for layer, counts in metrics["tokens_per_expert"].items()}
            if micro_batch_imbalance:
                metrics["ep_imbalance_micro_batch"] = {
                    str(layer): {"mean": micro_batch_imbalance[2 * i], "max": micro_batch_imbalance[2 * i + 1]}
                    for i, layer in enumerate(pending.moe_layers)}
            if not unplaced_rows:  # a step run again counts once, when it runs again
                metrics["moe_dead_experts"] = self.dead_experts.update(pending.step, metrics["tokens_per_expert"])
        return metrics

    def resolved_settings(self) -> dict:
        """What the run actually uses once ``auto`` settings are resolved (after a step has run: the MoE pipeline
        picks its transport and carve-out at its first call)."""
        o, t = self.cfg.overlap, self.cfg.train
        moe = [layer.mlp for layer in self.model.layers.values() if layer.is_moe]
        exchange = next((m.transports for m in moe if m.transports is not None), None)
        path = ("none" if not moe else "local" if moe[0].local else "pipeline" if moe[0].pipelined else "serial")
        return {
            "moe_path": path, "moe_pipeline": o.moe_pipeline,
            "moe_planning": exchange.planning if exchange is not None else ("host" if path == "serial" else None),
            "moe_transport": (exchange.name if exchange is not None
                              else dist.get_backend(self.mesh.ep.group) if path == "serial" else None),
            "moe_pipeline_chunks": o.moe_pipeline_chunks if path == "pipeline" else 1,
            "moe_token_slices": o.moe_token_slices if path == "pipeline" else 1,
            "moe_dispatch_once_per_rank": o.moe_dispatch_once_per_rank and path == "pipeline",
            "moe_cuda_graph": t.moe_cuda_graph, "moe_compute_only": o.moe_compute_only,
            "overlap_moe_expert_parallel_comm": o.overlap_moe_expert_parallel_comm,
            "delay_wgrad_compute": o.delay_wgrad_compute, "ep_comm_ctas": o.ep_comm_ctas,
            "moe_gemm_sm_carveout": sorted({m.last_overlap_sms for m in moe if m.last_overlap_sms is not None}),
            "paired_gemm_sm_carveout": (paired_gemm_sms(self.cfg, self.mesh)
                                        if o.overlap_moe_expert_parallel_comm else None),
            "dp_gemm_sm_carveout": dp_gemm_sms(self.cfg) if any(self._dp_overlaps.__dict__.values()) else None,
            "use_distributed_optimizer": t.use_distributed_optimizer, "overlap_grad_sync": o.overlap_grad_sync,
            "overlap_param_sync": o.overlap_param_sync, "expert_wgrad_micro_batches": t.expert_wgrad_micro_batches,
            "fp8_recipe": t.fp8_recipe, "fp8_wgrad": t.fp8_wgrad if t.fp8_recipe else None,
            "fp8_gemm_min_dim": fp8_gemm_min_dim(t) if t.fp8_recipe else None,
            "fp8_dgrad_accumulation": ("fast" if fp8_fast_dgrad(t) else "exact") if t.fp8_recipe else None,
            "fp8_param": fp8_param(t) if t.fp8_recipe else None,
        }

    def _world_stats(self) -> torch.Tensor:
        """(rows past the device-planned exchange's chunk bounds summed over the ranks and MoE layers of this step,
        those of them that no overflow chunk took (the step runs again), the most memory any rank holds: torch's
        allocator peak plus symmetric memory, which it does not see, then its reserved peak plus symmetric memory,
        and the most bytes any rank's pipelined MoE exchange sent to other ranks), fp64 on the device: one small
        all-gather over the world where any needs it, no host sync."""
        zero = torch.zeros((), dtype=torch.int64, device=self.device)
        exchange = self._exchange
        overflow, unplaced, sent = (zero, zero, zero) if exchange is None else exchange.counters()
        peaks = [0.0, 0.0]
        if self.device.type == "cuda":
            symmetric = symmetric_memory_bytes()
            peaks = [float(torch.cuda.max_memory_allocated(self.device) + symmetric),
                     float(torch.cuda.max_memory_reserved(self.device) + symmetric)]
        peaks_on_device = to_device_async(torch.tensor(peaks, dtype=torch.float64), self.device)
        mine = torch.cat([overflow.view(1).double(), unplaced.view(1).double(), peaks_on_device, sent.view(1).double()])
        if self.mesh.world_size == 1 or not (self._bounded or self.device.type == "cuda" or self._counted):
            return mine
        every = all_gather_into(mine.new_empty(self.mesh.world_size * 5), mine, dist.group.WORLD).view(-1, 5)
        return torch.cat([every[:, :2].sum(0), every[:, 2:].amax(dim=0)])

    def _dp_mean(self, values: torch.Tensor) -> torch.Tensor:
        all_reduce_(values, self.mesh.dp.group)
        return values / self.mesh.dp.size

    def _step_expert_load(self) -> dict[int, torch.Tensor]:
        """Copies sent to each expert this step per MoE layer, summed over the micro-batches, the
        data-parallel ranks and the TP and CP ranks (under sequence and context parallelism each routes its
        own tokens): the same on every rank, as the routers' bias update needs."""
        return {layer: all_reduce_(all_reduce_(counts_ME.sum(0), self.mesh.tp.group), self.mesh.dp_cp.group)
                for layer, counts_ME in self.tokens_per_micro_batch.items()}

    def _micro_batch_ep_imbalance(self) -> torch.Tensor:
        """``micro_batch_imbalance`` of this step's copies summed over the EP group (empty at EP=1)."""
        ep = self.mesh.ep
        if ep.size == 1 or not self.tokens_per_micro_batch:
            return torch.zeros(0, dtype=torch.float64, device=self.device)
        return micro_batch_imbalance(all_reduce_(torch.stack(list(self.tokens_per_micro_batch.values())), ep.group),
                                     ep.size)

    @torch.no_grad()
    def evaluate(self) -> float:
        """The validation loss; a bounded device-planned exchange is planned on the host here (exact: no step to
        run again)."""
        self.model.eval()
        with host_planned_rerun(self._moe_layers) if self._bounded else contextlib.nullcontext():
            return float(self._dp_mean(self.pipeline.evaluate(self.val_batches).view(1)))

    # ------------------------------------------------------------------------------------ checkpoints
    def model_buffers(self) -> dict[str, torch.Tensor]:
        """Persistent model buffers (the routers' expert bias and load) under their logical names. The
        optimizer owns the parameters; these are not trained, and are the same on every rank."""
        params = {name for name, _ in self.model.named_parameters()}
        return {f"model.{name}": tensor for name, tensor in self.model.state_dict(keep_vars=True).items()
                if name not in params}

    def _checkpoint_state(self, step: int) -> dict[str, torch.Tensor]:
        """What a checkpoint holds, by logical name: optimizer state, model buffers and the step."""
        return dict(self.optimizer.logical_state(), **self.model_buffers(), **{"train.step": torch.tensor(step)})

    def save(self, stopped_by: str | None = None) -> Path:
        per_rank = {"torch_rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state() if self.device.type == "cuda" else None}
        # A tied embedding's copy on the last pipeline stage equals the first stage's, which is saved (and loads
        # into both).
        copies = [name for name, param in self.model.named_parameters() if param_info(param).tied_copy]
        state = {key: tensor for key, tensor in self._checkpoint_state(self.step).items()
                 if not any(key == f"model.{name}" or key.startswith(f"optimizer.{name}.") for name in copies)}
        path = save_checkpoint(self.cfg.checkpoint_dir, self.step, state, per_rank, self.cfg.checkpoint.keep_last,
                               stopped_by)
        self.saved_step = self.step
        return path

    def resume(self) -> bool:
        """Continue from the newest good checkpoint, if any (also under another EP or DP size). A damaged newer
        one is moved aside with a warning naming both; a checkpoint of another model is refused (ConfigError)."""
        root = self.cfg.checkpoint_dir
        step, damaged = newest_good_checkpoint(root)
        if self.is_logger:
            for bad, problem in damaged:
                log.warning("checkpoint %s is damaged: %s; moved to %s%s; %s", step_dir(root, bad), problem,
                            step_dir(root, bad).name, DAMAGED_SUFFIX,
                            f"using {step_dir(root, step)} instead" if step is not None else "no older checkpoint")
        if step is None:
            if damaged:
                raise ConfigError("checkpoint.dir", str(root), "holds only damaged checkpoints, now moved to "
                                  f"step_N{DAMAGED_SUFFIX}; restore them, or run again to start from step 0")
            return False
        tensors = self._checkpoint_state(0)
        check_checkpoint_matches(root, step, tensors)
        per_rank = load_checkpoint(root, step, tensors)
        self.optimizer.after_load()
        self.step = self.saved_step = int(tensors["train.step"])
        if per_rank is not None:
            torch.set_rng_state(per_rank["torch_rng"])
            if per_rank["cuda_rng"] is not None and self.device.type == "cuda":
                torch.cuda.set_rng_state(per_rank["cuda_rng"])
        log.info("resumed from %s at step %d", step_dir(root, step), self.step)
        return True

    def _start_or_resume(self) -> None:
        """train.resume: auto, true and required continue from the newest good checkpoint; without one, auto
        starts fresh, true warns and starts fresh, required fails (check_resume_setting). false starts fresh."""
        t = self.cfg.train
        check_resume_setting(self.cfg)
        if t.resume is False or self.resume():
            return
        (log.warning if t.resume is True else log.info)("no checkpoint under %s: starting from step 0",
                                                         self.cfg.checkpoint_dir)

    # -------------------------------------------------------------------------------------- the loop
    def fit(self, monitor: RankMonitor | None = None) -> list[dict]:
        """Train to train.max_steps, resuming per train.resume and saving every checkpoint.save_interval steps.
        The host queues step i+1 before it reads step i's numbers, so the GPU never waits for the host between
        steps; evaluation and checkpoints see the finished step. SIGTERM / SIGINT or train.exit_duration_min stop
        it with a checkpoint after the steps in hand (``stopped_by`` says why); ``monitor`` learns the phase."""
        t, ckpt = self.cfg.train, self.cfg.checkpoint
        phase = monitor.phase if monitor is not None else (lambda text: None)
        phase("checkpoint load")
        self._start_or_resume()
        if self.step >= t.max_steps:
            log.info("step %d already reaches train.max_steps=%d: nothing to train", self.step, t.max_steps)
        out_dir = Path(t.output_dir)
        if self.is_logger:
            out_dir.mkdir(parents=True, exist_ok=True)
            if self.device.type == "cuda":
                log.info("MFU against train.peak_tflops=%g; this GPU's bf16 GEMM measures %.0f TFLOP/s",
                         t.peak_tflops, measured_gemm_tflops(self.device))
            (out_dir / "config.yaml").write_text(config_yaml(self.cfg))  # what export reads the model from
        history: list[dict] = []
        profiler = StepProfiler.from_config(t, self.mesh.rank, out_dir)
        progress = Progress(t, self.step, self.is_logger, show_mfu=self.device.type == "cuda")
        # The stop agreement is a CPU collective, so the host can ask it while the GPU runs the queued step.
        stop_group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=t.distributed_timeout_s))
                      if dist.is_initialized() and self.device.type == "cuda" else None)
        with (progress, open(out_dir / "metrics.jsonl", "a") if self.is_logger else _Null() as metrics_file,
              StopRequests(t.exit_duration_min, self.device, self.mesh.rank) as stop_requests):
            pending, first = None, True
            while self.step < t.max_steps or pending is not None:
                if not first:  # every rank agrees before the next step is queued: a stop ends after the one in hand
                    phase(f"stop check after step {self.step}")
                    self.stopped_by = stop_requests.agreed(stop_group)
                launched = None
                if (not self.stopped_by and self.step < t.max_steps
                        and (pending is None or not self._needs_finished_model(pending.step))):
                    phase(f"train step {self.step + 1}")
                    with profiler.step(self.step + 1):
                        launched = self.launch_step()
                    first = False
                if pending is not None:
                    metrics = self._finish_or_save(pending)
                    if metrics.get("moe_rerun_rows"):
                        phase(f"train step {metrics['step']} again, planned on the host")
                        metrics, launched = self._run_again(pending, metrics, launched,
                                                            lambda: self._finish_or_save(self.launch_step()))
                    history.append(self._after_step(metrics, metrics_file, progress, phase))
                if self.stopped_by:
                    phase(f"checkpoint save of step {self.step}")
                    self.save(stopped_by=self.stopped_by)  # also when just saved: the pointer records why
                    return history
                pending = launched
        profiler.close()
        if ckpt.save_final and history:
            phase(f"checkpoint save of step {self.step}")
            self.save()
        return history

    def _needs_finished_model(self, step: int) -> bool:
        """Whether ``step`` is followed by an evaluation or a save, which must see its weights, not the next
        step's (or may be: a non-finite gradient under train.on_nonfinite_grad=stop): then the next step waits
        until this one is read and done."""
        t, ckpt = self.cfg.train, self.cfg.checkpoint
        return bool((t.eval_interval and (step % t.eval_interval == 0 or step == t.max_steps))
                    or (ckpt.save_interval and step % ckpt.save_interval == 0 and step < t.max_steps)
                    or t.on_nonfinite_grad == "stop")

    def _after_step(self, metrics: dict, metrics_file, progress: Progress, phase) -> dict:
        """The evaluation and checkpoint due after a finished step; its metrics logged."""
        t, ckpt = self.cfg.train, self.cfg.checkpoint
        step = metrics["step"]
        if t.eval_interval and (step % t.eval_interval == 0 or step == t.max_steps):
            phase(f"evaluation after step {step}")
            metrics["val_loss"] = self.evaluate()
        if ckpt.save_interval and step % ckpt.save_interval == 0 and step < t.max_steps:
            phase(f"checkpoint save of step {step}")
            self.save()
        if self.is_logger and (step % t.log_interval == 0 or step == t.max_steps):
            metrics_file.write(json.dumps(metrics) + "\n")
            metrics_file.flush()
        progress.update(metrics)
        return metrics

    def _finish_or_save(self, pending: StepInFlight) -> dict:
        """finish_step; on a non-finite gradient norm under train.on_nonfinite_grad=stop, save the state before
        that step (its update was skipped on the device, and no later step was queued) and stop with a message
        that says where it is."""
        try:
            return self.finish_step(pending)
        except FloatingPointError as err:
            self.step = pending.step - 1
            if self.step == 0:
                raise
            path = step_dir(self.cfg.checkpoint_dir, self.step) if self.saved_step == self.step else self.save()
            raise FloatingPointError(f"{err}; the state after step {self.step} is in {path}") from err


def bounded_exchange(cfg: Config) -> bool:
    """Whether the MoE layers may plan a bounded exchange on the device (overlap.moe_expert_rank_capacity_factor, or
    the pool of overlap.moe_paged_stash_factor, with the pipeline over more than one expert rank, planned on the
    device or by auto): then every step reduces the overflow over the world and may run again."""
    o, p = cfg.overlap, cfg.parallel
    return (cfg.model.num_moe_experts is not None and o.moe_pipeline and o.moe_planning != "host"
            and (o.moe_expert_rank_capacity_factor is not None or o.moe_paged_stash_factor is not None)
            and p.expert_model_parallel_size * cfg.expert_tensor_parallel_size > 1)


@dataclass(frozen=True)
class DPOverlaps:
    grad_sync: bool  # gradient reduce-scatters start in the last micro-batch's backward
    param_sync: bool  # parameter all-gathers are waited for in the first micro-batch's forward


@dataclass
class StepInFlight:
    """What a queued optimizer step leaves on the device for the host to read once."""

    step: int  # 1-based, as the metrics count
    lr: float
    values: HostCopy  # fp64: data-parallel mean LM loss and auxiliary loss, gradient norm, applied, the non-finite
    # flags, the copies per expert of each MoE layer, then the rows past the exchange's bound, the memory peaks and
    # the exchange's bytes (Trainer._world_stats)
    moe_layers: list[int]
    exposed: ExposedComm
    start: Event  # the step's work starts after this (the previous step's end) ...
    end: Event  # ... and is done at this


class Progress:
    """Rank 0's view of the run: a tqdm bar when stdout and stderr are terminals; otherwise (a log file, a pipe)
    a plain line every train.log_interval steps and at the last, since a bar writes a carriage-return update per
    step into a log. MFU only on GPU: train.peak_tflops is a GPU's."""

    def __init__(self, train: TrainConfig, initial_step: int, enabled: bool, show_mfu: bool):
        self.train, self.enabled, self.show_mfu = train, enabled, show_mfu
        interactive = sys.stdout.isatty() and sys.stderr.isatty()
        self.bar = (tqdm(total=train.max_steps, initial=initial_step, unit="step", dynamic_ncols=True)
                    if enabled and interactive else None)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> bool:
        if self.bar is not None:
            self.bar.close()
        return False

    def update(self, metrics: dict) -> None:
        """After each finished step."""
        if not self.enabled:
            return
        shown = {"loss": f"{metrics['loss']:.3f}", "tok_s": f"{metrics['tokens_per_s']:.0f}"}
        if self.show_mfu:
            shown["mfu"] = f"{metrics['mfu']:.2f}"
        if "val_loss" in metrics:
            shown["val_loss"] = f"{metrics['val_loss']:.3f}"
        step, t = metrics["step"], self.train
        if self.bar is not None:
            self.bar.set_postfix(shown)
            self.bar.update(1)
        elif step % t.log_interval == 0 or step == t.max_steps:
            print(f"step {step}/{t.max_steps}", *(f"{key}={value}" for key, value in shown.items()), flush=True)


class _Null:
    """A do-nothing metrics file for ranks that do not log."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass
