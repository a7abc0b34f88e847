"""Pipeline stages: which layers each pipeline rank builds, and the forward of one model chunk.

Virtual stage s = c * PP + r is model chunk c on pipeline rank r (Megatron's interleaving); the layers run
in virtual-stage order, so rank r's chunks hold non-adjacent runs of layers. A rank builds one
:class:`MixtralModel` with all of its chunks' layers (named by their global index), the embedding if it
holds the first stage and the output layer if it holds the last; a :class:`ModelChunk` runs one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_overlap.config import Config, ModelConfig
from moe_overlap.models.mixtral import MixtralModel


def stage_layers(num_layers: int, pp: int, vpp: int = 1, first: int | None = None,
                 last: int | None = None) -> list[list[int]]:
    """Global layer indices of each virtual stage. The first and the last pipeline rank hold ``first`` and
    ``last`` layers when given (Megatron's num_layers_in_first/last_pipeline_stage), the other ranks an
    equal share of the rest, and each rank splits its layers evenly over its VPP chunks. The config's
    validation has checked that everything divides."""
    counts = [None] * pp
    if pp > 1:
        counts[0], counts[-1] = first, last
    rest = num_layers - sum(c for c in counts if c is not None)
    even = [r for r in range(pp) if counts[r] is None]
    for rank in even:
        counts[rank] = rest // len(even)
    stages, start = [], 0
    for stage in range(pp * vpp):
        size = counts[stage % pp] // vpp
        stages.append(list(range(start, start + size)))
        start += size
    return stages


@dataclass(frozen=True)
class PipelineStages:
    """The split of the layers over pipeline ranks and model chunks."""

    pp: int
    vpp: int
    layers: tuple[tuple[int, ...], ...]  # by virtual stage

    @classmethod
    def from_config(cls, cfg: Config) -> PipelineStages:
        p = cfg.parallel
        pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
        return cls(pp, vpp, tuple(tuple(s) for s in stage_layers(
            cfg.model.num_layers, pp, vpp, p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage)))

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    def stage(self, rank: int, chunk: int) -> int:
        return chunk * self.pp + rank

    def rank_layers(self, rank: int) -> list[int]:
        return [index for chunk in range(self.vpp) for index in self.layers[self.stage(rank, chunk)]]

    def model_kwargs(self, rank: int) -> dict:
        """What build_model needs to build this pipeline rank's part."""
        return {"layers": self.rank_layers(rank), "pre_process": rank == 0, "post_process": rank == self.pp - 1}


@dataclass
class ChunkOutput:
    output: torch.Tensor  # what backward starts from: the activation sent on, or (last stage) the scaled loss
    lm_loss: torch.Tensor | None  # detached mean cross-entropy (last stage only)
    aux_loss: torch.Tensor  # detached sum of this chunk's auxiliary losses
    tokens_per_expert: dict[int, torch.Tensor]


class AttachAuxLoss(torch.autograd.Function):
    """The identity on a stage's output, whose backward also gives the stage's auxiliary losses the gradient
    the loss scale gives every loss term (Megatron's MoEAuxLossAutoScaler): the auxiliary losses enter the
    stage's own backward, and no loss value crosses stages."""

    @staticmethod
    def forward(ctx, x_BSH: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux = scale, (aux_loss.dtype, aux_loss.device)
        return x_BSH.view_as(x_BSH)

    @staticmethod
    def backward(ctx, grad_BSH: torch.Tensor):
        dtype, device = ctx.aux
        return grad_BSH, torch.full((), ctx.scale, dtype=dtype, device=device), None


class ModelChunk:
    """One virtual stage of a rank's model: its layers, behind the embedding on the first stage and before
    the output layer and loss on the last."""

    def __init__(self, model: MixtralModel, layers: tuple[int, ...], first: bool, last: bool):
        self.model, self.layers, self.first, self.last = model, layers, first, last

    def __call__(self, input_: torch.Tensor, labels_BS: torch.Tensor, loss_scale: float) -> ChunkOutput:
        """``input_``: token ids (first stage) or the previous stage's activations (batch, seq block, hidden)."""
        x_BSH = self.model.embedding(input_) if self.first else input_
        x_BSH, aux_loss, tokens_per_expert = self.model.run_layers(x_BSH, self.layers)
        if self.last:
            lm_loss = self.model.head_loss(x_BSH, labels_BS)
            return ChunkOutput((lm_loss + aux_loss) * loss_scale, lm_loss.detach(), aux_loss.detach(),
                               tokens_per_expert)
        return ChunkOutput(AttachAuxLoss.apply(x_BSH, aux_loss, loss_scale), None, aux_loss.detach(),
                           tokens_per_expert)


def model_chunks(model: MixtralModel, stages: PipelineStages, rank: int) -> list[ModelChunk]:
    return [ModelChunk(model, stages.layers[stages.stage(rank, chunk)], stages.stage(rank, chunk) == 0,
                       stages.stage(rank, chunk) == stages.num_stages - 1) for chunk in range(stages.vpp)]


def stage_forward_flops(cfg: ModelConfig, layers: tuple[int, ...], last: bool, tokens: int) -> float:
    """Model FLOPs of one chunk's forward over ``tokens`` tokens (GEMMs and attention scores; full, not
    causal-halved, attention, as Megatron counts): the simulator's default action costs."""
    h, seq = cfg.hidden_size, cfg.seq_length
    attention = 2 * tokens * h * (h + 2 * cfg.query_groups * cfg.head_dim) + 2 * tokens * h * h + 4 * tokens * seq * h
    flops = 0.0
    for index in layers:
        flops += attention
        if cfg.is_moe_layer(index):
            flops += 2 * tokens * h * cfg.num_moe_experts  # router
            flops += cfg.moe_router_topk * 6 * tokens * h * cfg.expert_ffn_hidden_size
            flops += 6 * tokens * h * (cfg.moe_shared_expert_intermediate_size or 0)
        else:
            flops += 6 * tokens * h * cfg.ffn_hidden_size
    if last:
        flops += 2 * tokens * h * cfg.vocab_size
    return flops
