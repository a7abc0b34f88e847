"""What a run settles before its Trainer exists: the device, the process groups and the mesh (``init_distributed``),
the checks that can fail before any rank starts (``check_inputs``), the SMs GEMMs leave to the communication beside
them, and the ``auto`` switches that only the fabric decides (``resolve_by_fabric``, the same on every rank)."""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from moe_overlap import tuning
from moe_overlap.config import Config, ConfigError, validate_for_world
from moe_overlap.config.defaults import (DELAY, GRAPH, PAIRED, delay_by_planning, graphs_by_planning,
                                          pairing_by_transport, streams_off_reason)
from moe_overlap.distributed.a2a import exchange_choice
from moe_overlap.distributed.collectives import nccl_cta_options, rendezvous_store
from moe_overlap.distributed.mesh import Mesh, MeshLayout
from moe_overlap.distributed.streams import carveout_for
from moe_overlap.exchange_rules import NEEDS
from moe_overlap.training.checkpoint import complete_steps
from moe_overlap.training.data import load_data
from moe_overlap.training.streams_memory import allocator_budget, streams_bytes, streams_fit

log = logging.getLogger(__name__)


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
        timeout = timedelta(seconds=cfg.train.distributed_timeout_s)
        store = rendezvous_store(timeout)
        ranked = {} if store is None else {"rank": int(os.environ["RANK"]), "world_size": world_size}
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout, store=store, **ranked)
        if store is not None:
            store.set_timeout(timeout)  # joined: from now on a missing rank is noticed within the collective timeout
    return Mesh.create(mesh_layout(cfg, world_size), timeout_s=cfg.train.distributed_timeout_s,
                       pg_options=mesh_group_options(cfg)), device


def mesh_group_options(cfg: Config) -> dict:
    """Backend options by mesh group kind: ``overlap.dp_comm_ctas`` holds the data-parallel communicators
    (the plain optimizer's dp, the distributed optimizer's dp_cp, and edp) to that many CTAs, and
    ``overlap.ep_comm_ctas`` the expert-parallel one (ep)."""
    dp, ep = cfg.overlap.dp_comm_ctas, cfg.overlap.ep_comm_ctas
    options = {} if dp is None else {kind: nccl_cta_options(dp) for kind in ("dp", "dp_cp", "edp")}
    return options if ep is None else dict(options, ep=nccl_cta_options(ep))


def dp_gemm_sms(cfg: Config) -> int:
    """SMs the GEMMs beside the distributed optimizer's overlapped syncs leave free: ``overlap.gemm_sm_carveout``;
    auto: tuning.DP_NCCL_SMS_PER_CTA x dp_comm_ctas, none without a CTA cap."""
    return carveout_for(cfg.overlap.gemm_sm_carveout, cfg.overlap.dp_comm_ctas, tuning.DP_NCCL_SMS_PER_CTA)


def paired_gemm_sms(cfg: Config, mesh: Mesh) -> int:
    """SMs every GEMM leaves free while another micro-batch's exchange runs beside it
    (``overlap_moe_expert_parallel_comm``): ``overlap.gemm_sm_carveout``; auto: 2 x ep_comm_ctas (the NCCL pairing
    measured for the MoE layer's exchange), none without a CTA cap or an exchange (one EP rank)."""
    if mesh.ep.size * mesh.etp.size == 1:
        return 0
    return carveout_for(cfg.overlap.gemm_sm_carveout, cfg.overlap.ep_comm_ctas, tuning.EP_NCCL_SMS_PER_CTA)


def mesh_layout(cfg: Config, world_size: int) -> MeshLayout:
    p = cfg.parallel
    return MeshLayout(world_size=world_size, tp=p.tensor_model_parallel_size, cp=p.context_parallel_size,
                      pp=p.pipeline_model_parallel_size, ep=p.expert_model_parallel_size,
                      etp=cfg.expert_tensor_parallel_size)


def check_resume_setting(cfg: Config) -> None:
    """train.resume against checkpoint.dir: required needs a checkpoint; false refuses checkpoints that this
    run's saves would overwrite."""
    t, ckpt, root = cfg.train, cfg.checkpoint, cfg.checkpoint_dir
    steps = complete_steps(root)
    if t.resume == "required" and not steps:
        raise ConfigError("train.resume", "required", f"no checkpoint under {root} to resume from")
    if t.resume is False and steps and (ckpt.save_interval or ckpt.save_final):
        raise ConfigError("train.resume", False, f"{root} holds checkpoints up to step {max(steps)}, which this "
                          "run's saves would overwrite: use train.resume=auto to continue from them, or another "
                          "checkpoint.dir")


def check_inputs(cfg: Config) -> None:
    """What can fail before any rank starts: the data (the token file, its index, room for train.eval_iters) and
    train.resume against checkpoint.dir."""
    load_data(cfg)
    check_resume_setting(cfg)


def resolve_by_fabric(cfg: Config, mesh: Mesh, device: torch.device) -> None:
    """The ``auto`` switches config/defaults.py left to the fabric, the same on every rank, each logged once:
    pairing (``overlap.overlap_moe_expert_parallel_comm``: paired where this rank's exchange runs over NCCL with
    micro-batches to pair, or through one host's peer memory on two streams with graphed MoE layers where they fit
    every rank's GPU), then graphed MoE layers (``train.moe_cuda_graph``) and delayed weight gradients
    (``overlap.delay_wgrad_compute``), each on where the exchange is planned on the device, unpaired."""
    o, t = cfg.overlap, cfg.train
    if "auto" not in (o.overlap_moe_expert_parallel_comm, t.moe_cuda_graph, o.delay_wgrad_compute):
        return
    planning, transport, _ = exchange_choice(o.moe_planning, o.moe_transport, mesh.ep.group, mesh.ep.ranks, device,
                                             mesh.etp.size)
    if o.overlap_moe_expert_parallel_comm == "auto":
        micro_batches = cfg.num_micro_batches(mesh.world_size)
        pairing = pairing_by_transport(transport, micro_batches)
        one_rank = cfg.parallel.expert_model_parallel_size * cfg.expert_tensor_parallel_size == 1
        # through one host's peer memory with device-planned sizes (graph-replayable), or nothing exchanged
        local = (NEEDS[transport].one_host and planning == "device") or one_rank
        off = streams_off_reason(cfg) if local else None
        on_streams = local and micro_batches >= 2 and off is None
        if on_streams:
            pairing = streams_by_memory(cfg, mesh, device)
        elif off is not None:
            pairing = (False, f"{pairing[1]}; not on two streams: {off}")
        o.overlap_moe_expert_parallel_comm = _agreed(mesh, device, {PAIRED: pairing})[PAIRED][0]
        if on_streams and o.overlap_moe_expert_parallel_comm and t.moe_cuda_graph == "auto":
            t.moe_cuda_graph = True
            if mesh.rank == 0:
                log.info("%s=auto -> true: pairs on two streams replay their MoE layers from graphs", GRAPH)
    paired = o.overlap_moe_expert_parallel_comm is True
    choices = {}
    if t.moe_cuda_graph == "auto":
        choices[GRAPH] = graphs_by_planning(planning, device.type, paired)
    if o.delay_wgrad_compute == "auto":
        choices[DELAY] = delay_by_planning(planning, paired)
    agreed = _agreed(mesh, device, choices)
    t.moe_cuda_graph = agreed.get(GRAPH, (t.moe_cuda_graph,))[0]
    o.delay_wgrad_compute = agreed.get(DELAY, (o.delay_wgrad_compute,))[0]
    if t.moe_cuda_graph is True and o.moe_planning == "auto":
        o.moe_planning = "device"  # what the transport plans anyway; the rules and the trainer's record read it


def streams_by_memory(cfg: Config, mesh: Mesh, device: torch.device) -> tuple[bool, str]:
    """Pairs on two streams where this rank's estimate (training/streams_memory.py) fits its GPU's allocator."""
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    return streams_fit(streams_bytes(cfg, Mesh.planned(mesh.layout, mesh.rank)), allocator_budget(total, fraction))


def _agreed(mesh: Mesh, device: torch.device, choices: dict[str, tuple[bool, str]]) -> dict[str, tuple[bool, str]]:
    """Each field's (value, why), on only where every rank chose it (the schedule and graph captures are
    collective); logged on rank 0."""
    if choices and dist.is_initialized() and mesh.world_size > 1:
        agreed = torch.tensor([int(on) for on, _ in choices.values()], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        choices = {name: (False, "another rank chose otherwise") if on and not all_on else (on, why)
                   for (name, (on, why)), all_on in zip(choices.items(), agreed.tolist())}
    if mesh.rank == 0:
        for name, (on, why) in choices.items():
            log.info("%s=auto -> %s: %s", name, str(on).lower(), why)
    return choices
