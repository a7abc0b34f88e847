"""Pipeline stages: which layers each pipeline rank builds, and the forward of one model chunk.

Words: a (virtual) stage is one slice of the layers in pipeline order; virtual stage s = c * PP + r is model
chunk c on pipeline rank r (Megatron's interleaving), so rank r's chunks hold non-adjacent runs of layers. PP=1
is one stage, one chunk: the whole model. A rank builds one :class:`MixtralModel` with all of its chunks'
layers (named by their global index), the embedding if it holds the first stage and the output layer if it
holds the last; a :class:`ModelChunk` runs one chunk's forward as segments: functions of one micro-batch's
carry, between which the executor may cut the autograd graph (training/microbatch_overlap.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from moe_overlap.config import Config, ModelConfig
from moe_overlap.models.mixtral import MixtralModel, ModelOutput, Stage

Segment = Stage  # a function of a micro-batch's carry (a dict) returning what it adds to it


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

    def most_moe_layers(self, rank: int, model: ModelConfig) -> int:
        """The most MoE layers in one of this pipeline rank's model chunks (a unit in flight holds one chunk's)."""
        return max(sum(map(model.is_moe_layer, self.layers[self.stage(rank, chunk)])) for chunk in range(self.vpp))

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
    the output layer and loss on the last, as segments of one micro-batch's carry.

    The carry (:meth:`carry`) starts with the input (``input_ids`` on the first stage, else ``x``, the previous
    stage's activations (batch, seq block, hidden)), ``labels`` (last stage), ``micro_batch`` (its index) and
    ``loss_scale``; the last segment adds ``output``, a :class:`ChunkOutput`. :attr:`whole` is one segment, the
    chunk's plain forward (recomputation and graphed MoE layers as configured; on a whole model through the
    model's own call, so that hooks on it fire). :attr:`split` is the embedding | each layer's stages
    (TransformerLayer.stages: a MoE layer whose exchange runs is cut at its exchanges) | ``head`` (the loss) or
    ``stage{s}.output`` (the activations sent on): the segments that overlap_moe_expert_parallel_comm
    interleaves with another micro-batch's."""

    def __init__(self, model: MixtralModel, layers: tuple[int, ...], stage: int, first: bool, last: bool):
        self.model, self.layers, self.stage, self.first, self.last = model, layers, stage, first, last

    def carry(self, input_: torch.Tensor, labels_BS: torch.Tensor | None, micro_batch: int, loss_scale: float,
              split: bool) -> dict:
        carry = {"input_ids" if self.first else "x": input_, "labels": labels_BS, "micro_batch": micro_batch,
                 "loss_scale": loss_scale}
        if split:  # what the layers' stages add to
            carry.update(aux=input_.new_zeros((), dtype=torch.float32), tokens={})
        return carry

    @cached_property
    def whole(self) -> list[tuple[str, Segment]]:
        def forward(carry: dict) -> dict:
            if self.first and self.last:
                out = self.model(carry["input_ids"], carry["labels"], micro_batch=carry["micro_batch"])
                return {"output": _scaled(out, carry["loss_scale"])}
            x_BSH = self.model.embedding(carry["input_ids"]) if self.first else carry["x"]
            return {"output": self._tail(*self.model.run_layers(x_BSH, self.layers, carry["micro_batch"]), carry)}

        return [(f"stage{self.stage}", forward)]

    @cached_property
    def split(self) -> list[tuple[str, Segment]]:
        segments = [("embedding", lambda carry: {"x": self.model.embedding(carry["input_ids"])})] if self.first else []
        segments += [step for index in self.layers for step in self.model.layers[str(index)].stages(index)]
        tail = "head" if self.last else f"stage{self.stage}.output"
        segments.append((tail, lambda carry: {"output": self._tail(carry["x"], carry["aux"], carry["tokens"], carry)}))
        return segments

    def _tail(self, x_BSH: torch.Tensor, aux_loss: torch.Tensor, tokens_per_expert: dict[int, torch.Tensor],
              carry: dict) -> ChunkOutput:
        if self.last:
            return _scaled(self.model.output(x_BSH, aux_loss, tokens_per_expert, carry["labels"]), carry["loss_scale"])
        return ChunkOutput(AttachAuxLoss.apply(x_BSH, aux_loss, carry["loss_scale"]), None, aux_loss.detach(),
                           tokens_per_expert)


def _scaled(out: ModelOutput, loss_scale: float) -> ChunkOutput:
    return ChunkOutput(out.loss * loss_scale, out.lm_loss, out.aux_loss, out.tokens_per_expert)


def model_chunks(model: MixtralModel, stages: PipelineStages, rank: int) -> list[ModelChunk]:
    return [ModelChunk(model, stages.layers[stage], stage, stage == 0, stage == stages.num_stages - 1)
            for stage in (stages.stage(rank, chunk) for chunk in range(stages.vpp))]


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
