"""Mixtral-style decoder assembled from the config: dense or MoE MLP per layer, GQA attention, RMSNorm.

Activations are (batch, seq, hidden); under sequence parallelism each TP rank holds (batch, seq / TP, hidden),
its block of every sequence, between the tensor-parallel regions (attention, dense MLP, output layer). Under
context parallelism "seq" is the CP rank's local sequence (seq / CP tokens: distributed/context_parallel.py);
only attention (a ring over the CP group), the router (which sees the whole micro-batch) and the loss know it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe_overlap.config import ModelConfig, OverlapConfig
from moe_overlap.distributed.a2a import TransportSelector
from moe_overlap.distributed.collectives import all_reduce_
from moe_overlap.distributed.context_parallel import CPComm
from moe_overlap.distributed.mesh import Mesh
from moe_overlap.distributed.ring import TPComm, TPOverlap, make_ring_transport
from moe_overlap.layers.attention import SelfAttention
from moe_overlap.layers.device_plan import overflow_chunks
from moe_overlap.layers.embedding import Embedding, lm_cross_entropy
from moe_overlap.layers.experts import ExpertWgradGroups, GroupedExperts
from moe_overlap.layers.fp8 import Fp8, check_fp8_device, refresh_weights
from moe_overlap.layers.init import init_parameters
from moe_overlap.layers.param_info import is_expert_param, is_tp_split, param_info
from moe_overlap.layers.mlp import SwiGLUMLP
from moe_overlap.layers.moe import MoELayer, capture_moe_layers
from moe_overlap.layers.norm import RMSNorm
from moe_overlap.layers.router import Router
from moe_overlap.layers.routing_replay import RoutingReplay
from moe_overlap.layers.sp_router import SequenceParallelRouter
from moe_overlap.layers.tp_linear import ColumnParallelLinear, RowParallelLinear


# (layer indices of one model chunk, the graphed copies of its MoE layers), by chunk; an int: one chunk, the model
CopyGroups = Union[int, Sequence[tuple[Sequence[int], int]]]


class TransformerLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, overlap: OverlapConfig, layer_index: int, mesh: Mesh,
                 transports: TransportSelector | None, comm: TPComm, device=None, dtype=None,
                 cp: CPComm | None = None):
        super().__init__()
        self.is_moe = cfg.is_moe_layer(layer_index)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon, device, dtype)
        self.self_attention = SelfAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups,
                                            cfg.rotary_base, comm, device, dtype, cp, cfg.head_dim, cfg.add_qkv_bias,
                                            (cfg.qk_layernorm_scope, cfg.norm_epsilon) if cfg.qk_layernorm else None)
        self.pre_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon, device, dtype)
        if self.is_moe:
            router = (SequenceParallelRouter.from_config(cfg, device, dtype, comm=comm, cp=cp)
                      if comm.sequence_shards > 1 or mesh.cp.size > 1 else None)
            self.mlp = MoELayer(cfg, overlap, mesh.ep, transports, device, dtype, router, mesh.etp, mesh.etp_ep)
        else:
            self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.ffn_hidden_size, device, dtype, comm)

    def forward(self, x_BSH: torch.Tensor, attention_only: bool = False, micro_batch: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Returns the output and, for a MoE layer, its auxiliary loss and tokens per expert; ``attention_only``:
        the residual stream after attention and the MLP's input (the first of :meth:`stages`, called through the
        module so that its forward pre-hooks, the distributed optimizer's parameter wait, fire). ``micro_batch``
        picks the graphed copy of the MoE layer that runs it (MoELayer.for_micro_batch)."""
        x_BSH = x_BSH + self.self_attention(self.input_layernorm(x_BSH))
        mlp_in = self.pre_mlp_layernorm(x_BSH)
        if attention_only:
            return x_BSH, mlp_in
        if self.is_moe:
            mlp_out, aux_loss, tokens_per_expert = self.mlp.run_micro_batch(micro_batch, mlp_in)
            return x_BSH + mlp_out, aux_loss, tokens_per_expert
        return x_BSH + self.mlp(mlp_in), None, None

    def stages(self, index: int) -> list[tuple[str, Stage]]:
        """The layer as stages (``overlap_moe_expert_parallel_comm``): functions of a micro-batch's carry (x: the
        layer's input, then its output; h: the residual stream after attention; m: the MLP's input; aux: the
        auxiliary losses so far; tokens: tokens per expert by layer) returning what they add to it. The autograd
        graph is cut between them (training/microbatch_overlap.py). A MoE layer whose exchange runs (the pipeline
        over more than one rank) is cut at its exchanges, each started at the end of one stage and waited for at
        the start of the next, by the layer's own three steps: attention, then router, permute, dispatch started |
        expert GEMMs, combine started (, shared expert) | combine waited, unpermute (, shared expert). Otherwise:
        attention | MLP (a one-rank MoE layer whole, so that train.moe_cuda_graph replays it)."""
        mlp = self.mlp

        def attention(carry: dict) -> dict:
            h_BSH, m_BSH = self(carry["x"], attention_only=True)
            return {"h": h_BSH, "m": m_BSH}

        def whole_mlp(carry: dict) -> dict:
            if not self.is_moe:
                return {"x": carry["h"] + mlp(carry["m"])}
            # graphed layers: each micro-batch in flight replays its own copy
            out_BSH, aux_loss, carry["tokens"][index] = mlp.run_micro_batch(carry["micro_batch"], carry["m"])
            return {"x": carry["h"] + out_BSH, "aux": carry["aux"] + aux_loss}

        if not (self.is_moe and mlp.stepped):
            return [(f"{index}.attention", attention), (f"{index}.mlp", whole_mlp)]

        def attention_dispatch(carry: dict) -> dict:
            out = attention(carry)
            with mlp.routing_slot(carry["micro_batch"]):
                routing, token, state = mlp.start_dispatch(out["m"].flatten(0, -2), paired=True)
            carry["tokens"][index] = routing.tokens_per_expert_E
            return dict(out, token=token, probs=routing.probs_TK, state=state,
                        aux=carry["aux"] + routing.aux_loss + routing.z_loss)

        def experts(carry: dict) -> dict:
            token, shared_TH = mlp.run_experts(carry["m"].flatten(0, -2), carry["token"], carry["state"])
            return {"token": token, "shared": shared_TH}

        def combine(carry: dict) -> dict:
            out_TH = mlp.finish_combine(carry["m"].flatten(0, -2), carry["token"], carry["probs"], carry["state"],
                                        carry["shared"])
            return {"x": carry["h"] + out_TH.view_as(carry["h"])}

        return [(f"{index}.attention", attention_dispatch), (f"{index}.experts", experts),
                (f"{index}.combine", combine)]


Stage = Callable[[dict], dict]  # TransformerLayer.stages


@dataclass
class ModelOutput:
    loss: torch.Tensor  # what backward runs on: cross-entropy + auxiliary losses
    lm_loss: torch.Tensor  # detached cross-entropy, for logging
    aux_loss: torch.Tensor  # detached sum of the MoE auxiliary losses
    tokens_per_expert: dict[int, torch.Tensor]  # layer index -> copies routed to each global expert


class MixtralModel(nn.Module):
    """The decoder, or one pipeline rank's part of it: ``layers`` (global indices; default all), the embedding
    with ``pre_process`` (first stage), the final norm and output layer with ``post_process`` (last stage).
    Layers keep their global index in their parameter names, so names, init and checkpoint keys are the
    same under every pipeline split."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh, device=None, dtype=None, recompute: bool = False,
                 overlap: OverlapConfig | None = None, timeout_s: float = 120.0, sequence_parallel: bool = False,
                 layers: Sequence[int] | None = None, pre_process: bool = True, post_process: bool = True):
        super().__init__()
        self.cfg, self.recompute = cfg, recompute
        self.pre_process, self.post_process = pre_process, post_process
        tied = cfg.share_embeddings_and_output_weights
        overlap = overlap or OverlapConfig(moe_pipeline=False)  # none given: the serial exchange
        if overlap.moe_pipeline == "auto":
            raise ValueError("overlap.moe_pipeline='auto' is resolved when the config is validated "
                             "(config.validate); a model takes true or false")
        tp_switches = tp_overlap(overlap)
        ring = None
        if tp_switches.any and mesh.tp.size > 1:
            ring = make_ring_transport(overlap.tp_comm_backend, mesh.tp, torch.device(device or "cpu"),
                                       overlap.tp_comm_num_splits, timeout_s)
        self.tp_comm = TPComm(mesh.tp, sequence_parallel, tp_switches, ring)
        self.cp_comm = CPComm(mesh.cp, overlap.cp_comm_overlap)
        transports = None
        if overlap.moe_pipeline and cfg.num_moe_experts and (mesh.ep.size > 1 or mesh.etp.size > 1):
            chunks = overlap.moe_pipeline_chunks + overflow_chunks(overlap)
            transports = TransportSelector(overlap.moe_planning, overlap.moe_transport, mesh.ep.group,  # every MoE
                                           mesh.ep.ranks, torch.device(device or "cpu"),  # layer shares one
                                           chunks, timeout_s, overlap.moe_compute_only, mesh.etp.size,
                                           push_ctas=overlap.ep_comm_ctas)
        # With tied weights the last stage keeps its own copy of the table for the output layer (Megatron's).
        self.embedding = (Embedding(cfg.vocab_size, cfg.hidden_size, self.tp_comm, device, dtype)
                          if pre_process or (post_process and tied) else None)
        self.layers = nn.ModuleDict({str(i): TransformerLayer(cfg, overlap, i, mesh, transports, self.tp_comm, device,
                                                              dtype, self.cp_comm)
                                     for i in (range(cfg.num_layers) if layers is None else layers)})
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon, device, dtype) if post_process else None
        self.output_layer = (None if tied or not post_process
                             else ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, self.tp_comm, device=device,
                                                       dtype=dtype))
        if tied and (pre_process != post_process):
            # Both copies get every gradient (summed over the embedding group, as Megatron); the last stage's
            # is not saved (the first stage's key loads into it) and counts once in the gradient norm.
            param_info(self.embedding.weight).tied_embedding = True
            param_info(self.embedding.weight).tied_copy = not pre_process
        if self.tp_comm.sequence_shards > 1:
            # Megatron's sequence-parallel parameters: replicated over TP (norms, routers), each rank's gradient
            # from its own sequence block, so the optimizer sums them over the TP group.
            for param in self.parameters():
                param_info(param).sequence_parallel = not (is_expert_param(param) or is_tp_split(param))

    def routers(self) -> dict[int, Router]:
        """The router of each MoE layer, keyed like ``ModelOutput.tokens_per_expert`` (layer index)."""
        return {int(index): layer.mlp.router for index, layer in self.layers.items() if layer.is_moe}

    def forward_units(self) -> list[tuple[nn.Module, tuple[str, ...]]]:
        """The model's parts in the order forward first uses them, as (the module whose forward starts
        the part, the name prefixes of its parameters): the embedding, each layer, then the head -- the
        final norm and the output layer, whose weight the loss reads without calling its forward. The
        distributed optimizer buckets parameters and waits for their all-gather by these parts."""
        units = [(self.embedding, ("embedding",))] if self.pre_process else []
        units += [(layer, (f"layers.{index}",)) for index, layer in self.layers.items()]
        if self.post_process:
            output = (("output_layer",) if self.output_layer is not None
                      else () if self.pre_process else ("embedding",))  # a tied copy on the last stage
            units.append((self.final_layernorm, ("final_layernorm",) + output))
        return units

    def group_expert_wgrads(self, micro_batches: int) -> None:
        """``train.expert_wgrad_micro_batches``: every MoE layer sums its experts' weight gradients that many
        micro-batches at a time (layers/experts.py, ExpertWgradGroups); the trainer marks each micro-batch with
        start_micro_batch."""
        for layer in self.layers.values():
            if layer.is_moe:
                layer.mlp.experts.wgrad_groups = ExpertWgradGroups(micro_batches)

    def replay_routing(self, replay: RoutingReplay, micro_batch_size: int, copies: CopyGroups = 1) -> None:
        """Every MoE layer's training calls route through ``replay`` (layers/routing_replay.py): call before
        graph_moe_layers, with the ``copies`` it will capture (routing_replay.replay_refusal says where it cannot)."""
        for indices, n in self._copy_groups(copies):
            for index in indices:
                self.layers[str(index)].mlp.attach_replay(replay, index, micro_batch_size * self.cfg.seq_length, n)

    def _copy_groups(self, copies: CopyGroups) -> list[tuple[list[int], int]]:
        """Each model chunk's MoE layer indices on this rank, with its copies."""
        groups = [(map(int, self.layers), copies)] if isinstance(copies, int) else copies
        return [([i for i in indices if str(i) in self.layers and self.layers[str(i)].is_moe], n)
                for indices, n in groups]

    def fp8_modules(self, bf16_at_start: int = 0, bf16_at_end: int = 0) -> Iterable[nn.Module]:
        """The modules whose GEMMs ``train.fp8_recipe`` runs in FP8: the experts and the linears of every layer of
        this stage but the first ``bf16_at_start`` and the last ``bf16_at_end`` of the model
        (train.num_layers_at_start_in_bf16 / _end_). The embedding, the output layer, routers, norms and attention
        itself stay bf16."""
        bf16 = set(range(bf16_at_start)) | set(range(self.cfg.num_layers - bf16_at_end, self.cfg.num_layers))
        for index, layer in self.layers.items():
            if int(index) not in bf16:
                yield from (module for module in layer.modules()
                            if isinstance(module, (ColumnParallelLinear, RowParallelLinear, GroupedExperts)))

    def use_fp8(self, fp8: Fp8, bf16_at_start: int = 0, bf16_at_end: int = 0) -> None:
        """``train.fp8_recipe``: the GEMMs of :meth:`fp8_modules` in FP8 (layers/fp8.py). Call before
        graph_moe_layers."""
        if not fp8.emulate:
            check_fp8_device(next(self.parameters()).device, fp8.recipe)
        for module in self.fp8_modules(bf16_at_start, bf16_at_end):
            module.fp8 = fp8

    def start_micro_batch(self, first: bool, last: bool) -> None:
        for layer in self.layers.values():
            if layer.is_moe and layer.mlp.experts.wgrad_groups is not None:
                layer.mlp.experts.wgrad_groups.start_micro_batch(first, last)

    def graph_moe_layers(self, micro_batch_size: int, copies: CopyGroups = 1,
                         replay_streams: tuple[torch.cuda.Stream, ...] | None = None) -> None:
        """Capture every MoE layer's forward and backward in CUDA graphs (``train.moe_cuda_graph``): from then
        on a training-mode call replays them, and the host issues one launch per layer and direction instead
        of a few hundred small ones. Needs the device-planned pipeline (no host sync, no collective in the layer),
        a fixed micro-batch shape, and the parameters' final storage (call after the optimizer is built). All
        ranks capture together: the warm-up calls exchange rows. Eval-mode calls run the layers eagerly.
        ``copies=n``: a set per micro-batch in flight (paired micro-batches, a pipeline stage's 1F1B); by model
        chunk under interleaved 1F1B, each chunk's own, captured apart: the graphs of one capture share a memory
        pool, so torch.cuda.make_graphed_callables needs their forwards in order and backwards in reverse, true of
        one chunk's forward and backward, not of two chunks' (other micro-batches run between them: captured
        together, a grouped GEMM found its group sizes overwritten, 2xH200);
        ``replay_streams``: the streams the sets replay on side by side (capture_moe_layers)."""
        shape = (micro_batch_size, self.cfg.seq_length // self.tp_comm.sequence_shards, self.cfg.hidden_size)
        for indices, n in self._copy_groups(copies):
            if indices:
                capture_moe_layers(tuple(self.layers[str(i)].mlp for i in indices), shape, n, replay_streams)
        moe_layers = tuple(layer.mlp for layer in self.layers.values() if layer.is_moe)
        for layer in moe_layers:  # a replay reads the FP8 weight copies the capture read: refresh them before it
            if layer.experts.fp8 is not None:  # (after the layer's wait for its parameters; hooks come after capture)
                for module in (layer, *layer.graph_copies):
                    module.register_forward_pre_hook(refresh_weights)

    def init_weights(self, seed: int) -> None:
        init_parameters(self, seed, self.cfg.init_method_std, self.cfg.num_layers, self.cfg.embedding_init_std)

    def forward(self, input_ids_BS: torch.Tensor, labels_BS: torch.Tensor, micro_batch: int = 0) -> ModelOutput:
        """``micro_batch``: its index, which picks the graphed MoE layers' copy (run_layers)."""
        x_BSH, aux_loss, tokens_per_expert = self.run_layers(self.embedding(input_ids_BS), self.layers.keys(),
                                                             micro_batch)
        return self.output(x_BSH, aux_loss, tokens_per_expert, labels_BS)

    def output(self, x_BSH: torch.Tensor, aux_loss: torch.Tensor, tokens_per_expert: dict[int, torch.Tensor],
               labels_BS: torch.Tensor) -> ModelOutput:
        """The head's loss on the last layer's output, with the auxiliary losses."""
        lm_loss = self.head_loss(x_BSH, labels_BS)
        logged = lm_loss.detach()
        if self.cp_comm.size > 1:  # this rank's share of the micro-batch mean; the gradient reduction sums the shares
            lm_loss = lm_loss / self.cp_comm.size
            logged = all_reduce_(lm_loss.detach().clone(), self.cp_comm.group.group)
        return ModelOutput(lm_loss + aux_loss, logged, aux_loss.detach(), tokens_per_expert)

    def run_layers(self, x_BSH: torch.Tensor, indices: Iterable[int | str], micro_batch: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """The given layers in order: their output, summed auxiliary loss and tokens per expert by layer
        (``micro_batch``: its index, which picks the graphed MoE layers' copy)."""
        aux_loss = x_BSH.new_zeros((), dtype=torch.float32)
        tokens_per_expert = {}
        for index in indices:
            layer = self.layers[str(index)]
            if self.recompute and torch.is_grad_enabled():
                x_BSH, layer_aux, layer_tokens = checkpoint(layer, x_BSH, micro_batch=micro_batch, use_reentrant=False)
            else:
                x_BSH, layer_aux, layer_tokens = layer(x_BSH, micro_batch=micro_batch)
            if layer_aux is not None:
                aux_loss = aux_loss + layer_aux
                tokens_per_expert[int(index)] = layer_tokens
        return x_BSH, aux_loss, tokens_per_expert

    def head_loss(self, x_BSH: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        """Final norm, output layer and the mean cross-entropy (the last stage's)."""
        output_weight = self.embedding.weight if self.output_layer is None else self.output_layer.weight
        return lm_cross_entropy(self.final_layernorm(x_BSH), output_weight, labels_BS, self.tp_comm)


def build_model(cfg: ModelConfig, mesh: Mesh, device: torch.device | str, dtype: torch.dtype, seed: int,
                recompute: bool = False, overlap: OverlapConfig | None = None,
                timeout_s: float = 120.0, sequence_parallel: bool = False, layers: Sequence[int] | None = None,
                pre_process: bool = True, post_process: bool = True) -> MixtralModel:
    """This rank's part of the model, initialised from the seed and each parameter's logical name."""
    model = MixtralModel(cfg, mesh, device, dtype, recompute, overlap, timeout_s, sequence_parallel, layers,
                         pre_process, post_process)
    model.init_weights(seed)
    return model


def tp_overlap(overlap: OverlapConfig) -> TPOverlap:
    """The TP overlap switches in force: each needs the master switch tp_comm_overlap."""
    on = overlap.tp_comm_overlap
    return TPOverlap(ag=on and overlap.tp_comm_overlap_ag, rs=on and overlap.tp_comm_overlap_rs,
                     rs_dgrad=on and overlap.tp_comm_overlap_rs_dgrad, bulk_dgrad=on and overlap.tp_comm_bulk_dgrad,
                     bulk_wgrad=on and overlap.tp_comm_bulk_wgrad, num_splits=overlap.tp_comm_num_splits)


def count_parameters(cfg: ModelConfig) -> int:
    """Logical parameter count (all experts), built on the meta device: no memory, no processes."""
    model = MixtralModel(cfg, Mesh.single(), device="meta", dtype=torch.float32)
    return sum(p.numel() for p in model.parameters())
