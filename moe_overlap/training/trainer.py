"""The training loop: gradient accumulation, AdamW with warmup + decay, evaluation, metrics, checkpoints."""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

from moe_overlap.config import Config, validate_for_world
from moe_overlap.distributed.collectives import all_reduce_, nccl_cta_options
from moe_overlap.distributed.mesh import Mesh, MeshLayout
from moe_overlap.distributed.streams import check_gemm_sm_carveout, gemm_sm_carveout
from moe_overlap.models.mixtral import build_model
from moe_overlap.models.pipeline_stages import PipelineStages
from moe_overlap.training.checkpoint import latest_step, load_checkpoint, save_checkpoint
from moe_overlap.training.data import BatchSampler, eval_batches, load_token_splits
from moe_overlap.training.dist_optimizer import DistributedOptimizer
from moe_overlap.training.optimizer import MixedPrecisionAdamW, lr_at
from moe_overlap.training.pipeline import PipelineExecutor

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
Optimizer = MixedPrecisionAdamW | DistributedOptimizer  # train.use_distributed_optimizer picks one


def resolve_device(cfg: Config) -> torch.device:
    wanted = cfg.train.device
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("train.device='cuda': no CUDA device is visible; use 'cpu' or 'auto'")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(cfg: Config) -> tuple[Mesh, torch.device]:
    """Join the job torchrun started (or the process group already there, or run as a single process)
    and build the mesh for the config."""
    device = resolve_device(cfg)
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    validate_for_world(cfg, world_size, device.type)
    if world_size == 1 and not dist.is_initialized():
        return Mesh.single(), device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=timedelta(seconds=cfg.train.distributed_timeout_s))
    return Mesh.create(mesh_layout(cfg, world_size), timeout_s=cfg.train.distributed_timeout_s,
                       pg_options=mesh_group_options(cfg)), device


def mesh_group_options(cfg: Config) -> dict:
    """Backend options by mesh group kind: ``overlap.dp_comm_ctas`` holds the data-parallel communicators
    (the plain optimizer's dp, the distributed optimizer's dp_cp, and edp) to that many CTAs."""
    ctas = cfg.overlap.dp_comm_ctas
    return {} if ctas is None else {kind: nccl_cta_options(ctas) for kind in ("dp", "dp_cp", "edp")}


def mesh_layout(cfg: Config, world_size: int) -> MeshLayout:
    p = cfg.parallel
    return MeshLayout(world_size=world_size, tp=p.tensor_model_parallel_size, cp=p.context_parallel_size,
                      pp=p.pipeline_model_parallel_size, ep=p.expert_model_parallel_size,
                      etp=cfg.expert_tensor_parallel_size)


class Trainer:
    def __init__(self, cfg: Config, mesh: Mesh, device: torch.device):
        validate_for_world(cfg, mesh.world_size, device.type)
        self.cfg, self.mesh, self.device = cfg, mesh, device
        t = cfg.train
        check_gemm_sm_carveout(cfg.overlap.gemm_sm_carveout, device)
        torch.manual_seed(t.seed)
        stages = PipelineStages.from_config(cfg)  # with PP, this rank builds only its stages' layers
        self.model = build_model(cfg.model, mesh, device, _DTYPES[t.precision], t.seed,
                                 recompute=t.recompute_granularity == "full", overlap=cfg.overlap,
                                 timeout_s=t.distributed_timeout_s, sequence_parallel=cfg.parallel.sequence_parallel,
                                 **stages.model_kwargs(mesh.pp.rank))
        self.optimizer = (DistributedOptimizer(self.model, mesh, t, cfg.overlap) if t.use_distributed_optimizer
                          else MixedPrecisionAdamW(self.model, mesh, t, cfg.overlap.grad_sync_dtype))
        self.pipeline = (PipelineExecutor(cfg, mesh, self.model, stages, self.optimizer, device, _DTYPES[t.precision])
                         if stages.pp > 1 else None)
        if t.moe_cuda_graph:  # after the optimizer: it may move the parameters into its buffers
            with gemm_sm_carveout(cfg.overlap.gemm_sm_carveout):  # the captured GEMMs keep the steps' carve-out
                self.model.graph_moe_layers(t.micro_batch_size)
        train_tokens, val_tokens = load_token_splits(cfg.data.path, cfg.data.dtype, cfg.data.validation_fraction,
                                                     seq_length=cfg.model.seq_length)
        dp = mesh.dp
        self.sampler = BatchSampler(train_tokens, cfg.model.seq_length, t.global_batch_size, t.micro_batch_size,
                                    dp.rank, dp.size, t.seed)
        self.val_batches = [] if not t.eval_interval else eval_batches(
            val_tokens, cfg.model.seq_length, t.micro_batch_size,
            t.eval_iters * t.global_batch_size // t.micro_batch_size, dp.rank, dp.size)
        self.num_micro_batches = cfg.num_micro_batches(mesh.world_size)
        self.step = 0
        self.tokens_per_expert: dict[int, torch.Tensor] = {}
        self.is_logger = mesh.rank == 0

    # ------------------------------------------------------------------------------------------ steps
    def forward_backward(self, step: int) -> tuple[float, float]:
        """Accumulate one global batch's gradients; returns this rank's mean LM and auxiliary losses."""
        self.model.train()
        # Each micro-batch's loss is a mean over its tokens; dividing by every micro-batch of every
        # data-parallel rank makes the summed gradients those of the global-batch mean.
        loss_scale = 1.0 / (self.num_micro_batches * self.mesh.dp.size)
        if self.pipeline is not None:  # the schedule's executor runs every micro-batch through the stages
            result = self.pipeline.run(list(self.sampler.micro_batches(step)), loss_scale)
            self.tokens_per_expert = result.tokens_per_expert
            return float(result.lm_loss), float(result.aux_loss)
        lm_total = aux_total = 0.0
        self.tokens_per_expert = {}
        for index, (input_ids, labels) in enumerate(self.sampler.micro_batches(step)):
            self.optimizer.start_micro_batch(is_last=index == self.num_micro_batches - 1)
            out = self.model(input_ids.to(self.device), labels.to(self.device))
            (out.loss * loss_scale).backward()
            lm_total += float(out.lm_loss)
            aux_total += float(out.aux_loss)
            for layer, counts in out.tokens_per_expert.items():
                self.tokens_per_expert[layer] = self.tokens_per_expert.get(layer, 0) + counts
        return lm_total / self.num_micro_batches, aux_total / self.num_micro_batches

    def train_step(self, inspect_grads: Callable[[Optimizer], None] | None = None) -> dict:
        """One optimizer step; ``inspect_grads`` sees the reduced gradients before the update (tests)."""
        start = time.perf_counter()
        lr = lr_at(self.step, self.cfg.train)
        with gemm_sm_carveout(self.cfg.overlap.gemm_sm_carveout):
            lm_loss, aux_loss = self.forward_backward(self.step)
            self.optimizer.reduce_grads()
            if inspect_grads is not None:
                inspect_grads(self.optimizer)
            grad_norm, stepped = self.optimizer.step(lr, self.step)
        loads = self._step_expert_load()
        for layer, router in self.model.routers().items():
            router.update_load(loads[layer])
        losses = self._dp_mean(torch.tensor([lm_loss, aux_loss], dtype=torch.float64, device=self.device))
        elapsed = time.perf_counter() - start
        self.step += 1
        tokens = self.cfg.train.global_batch_size * self.cfg.model.seq_length
        metrics = {"step": self.step, "loss": losses[0], "aux_loss": losses[1], "lr": lr, "grad_norm": grad_norm,
                   "skipped": not stepped, "step_time_s": elapsed, "tokens_per_s": tokens / elapsed}
        if self.device.type == "cuda":
            metrics["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if loads:
            metrics["tokens_per_expert"] = {str(layer): counts.tolist() for layer, counts in loads.items()}
        return metrics

    def _dp_mean(self, values: torch.Tensor) -> list[float]:
        all_reduce_(values, self.mesh.dp.group)
        return (values / self.mesh.dp.size).tolist()

    def _step_expert_load(self) -> dict[int, torch.Tensor]:
        """Copies sent to each expert this step per MoE layer, summed over the micro-batches, the
        data-parallel ranks and the TP ranks (under sequence parallelism each routes its own sequence
        block): the same on every rank, as the routers' bias update needs."""
        return {layer: all_reduce_(all_reduce_(counts, self.mesh.tp.group), self.mesh.dp.group)
                for layer, counts in self.tokens_per_expert.items()}

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        if self.pipeline is not None:
            return self._dp_mean(torch.tensor([self.pipeline.evaluate(self.val_batches)], dtype=torch.float64,
                                              device=self.device))[0]
        total = sum(float(self.model(ids.to(self.device), labels.to(self.device)).lm_loss)
                    for ids, labels in self.val_batches)
        return self._dp_mean(torch.tensor([total / len(self.val_batches)], dtype=torch.float64,
                                          device=self.device))[0]

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

    def save(self) -> Path:
        per_rank = {"torch_rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state() if self.device.type == "cuda" else None}
        # A tied embedding's copy on the last pipeline stage equals the first stage's, which is saved (and loads
        # into both).
        copies = [name for name, param in self.model.named_parameters() if getattr(param, "shared", False)]
        state = {key: tensor for key, tensor in self._checkpoint_state(self.step).items()
                 if not any(key == f"model.{name}" or key.startswith(f"optimizer.{name}.") for name in copies)}
        return save_checkpoint(self.cfg.checkpoint_dir, self.step, state, per_rank, self.cfg.checkpoint.keep_last)

    def resume(self) -> bool:
        """Continue from the newest complete checkpoint, if any (also under another EP or DP size)."""
        step = latest_step(self.cfg.checkpoint_dir)
        if step is None:
            return False
        tensors = self._checkpoint_state(0)
        per_rank = load_checkpoint(self.cfg.checkpoint_dir, step, tensors)
        self.optimizer.after_load()
        self.step = int(tensors["train.step"])
        if per_rank is not None:
            torch.set_rng_state(per_rank["torch_rng"])
            if per_rank["cuda_rng"] is not None and self.device.type == "cuda":
                torch.cuda.set_rng_state(per_rank["cuda_rng"])
        log.info("resumed from %s at step %d", self.cfg.checkpoint_dir, self.step)
        return True

    # -------------------------------------------------------------------------------------- the loop
    def fit(self) -> list[dict]:
        t, ckpt = self.cfg.train, self.cfg.checkpoint
        if t.resume:
            self.resume()
        out_dir = Path(t.output_dir)
        if self.is_logger:
            out_dir.mkdir(parents=True, exist_ok=True)
        history = []
        bar = tqdm(total=t.max_steps, initial=self.step, disable=not self.is_logger, unit="step", dynamic_ncols=True)
        with bar, open(out_dir / "metrics.jsonl", "a") if self.is_logger else _Null() as metrics_file:
            while self.step < t.max_steps:
                metrics = self.train_step()
                if t.eval_interval and (self.step % t.eval_interval == 0 or self.step == t.max_steps):
                    metrics["val_loss"] = self.evaluate()
                if ckpt.save_interval and self.step % ckpt.save_interval == 0 and self.step < t.max_steps:
                    self.save()
                history.append(metrics)
                if self.is_logger and (self.step % t.log_interval == 0 or self.step == t.max_steps):
                    metrics_file.write(json.dumps(metrics) + "\n")
                    metrics_file.flush()
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
                bar.update(1)
        if ckpt.save_final and history:
            self.save()
        return history


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
