"""Context parallelism on CPU gloo ranks: the load-balanced split and schedule (every causal pair once, the same
work on every rank), ring attention against one full attention (alone, on the ring with and without overlap),
the whole model at CP=2 and CP=4 alone and with TP, EP, DP and the distributed optimizer and recomputation
against the single-process run, a checkpoint moved between CP sizes, and bad configs (the benchmark's smoke runs:
test_bench_cp_attention_smoke.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_overlap.config import ConfigError, load_config, validate_for_world
from moe_overlap.distributed.context_parallel import CPComm, GatherSequence, local_rows, positions, split_sequence
from moe_overlap.distributed.mesh import GroupHandle
from moe_overlap.distributed.ring import P2PTransport
from moe_overlap.layers.ring_attention import (KERNELS, blockwise_backward, blockwise_forward, ring_attention,
                                               ring_schedule)
from moe_overlap.training.trainer import Trainer
from tests.test_master import (CPU, TOL, equivalence_case, rel_err, run_and_save, small_config, tp_layout,
                               world_and_mesh)

# ------------------------------------------------------------------------------------ split and schedule


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_split_positions_and_gather_agree(size):
    seq = 24
    held = [positions(seq, rank, size) for rank in range(size)]
    assert torch.equal(torch.sort(torch.cat(held)).values, torch.arange(seq))  # every token on one rank
    tokens_BS = torch.arange(2 * seq).view(2, seq)
    for rank in range(size):
        assert torch.equal(split_sequence(tokens_BS, 1, rank, size), tokens_BS[:, held[rank]])
        comm = CPComm(GroupHandle(ranks=list(range(size)), group=None, rank=rank, size=size))
        assert torch.equal(local_rows(tokens_BS.flatten(), 2, comm), tokens_BS[:, held[rank]].flatten())
    if size > 1:
        chunk = seq // (2 * size)
        assert held[0][:chunk].tolist() == list(range(chunk)) and held[0][-1] == seq - 1  # chunks 0 and 2N-1


def attended_pairs(rank: int, size: int, seq: int) -> list[tuple[int, int]]:
    """(query position, key position) pairs rank ``rank`` computes over its ring, from the schedule's rows."""
    local = seq // size
    mine = positions(seq, rank, size)
    pairs = []
    for block in ring_schedule(rank, size, local):
        theirs = positions(seq, block.source, size)
        for qi in range(local)[block.queries]:
            for ki in range(local)[block.keys]:
                if not block.causal or ki <= qi:
                    pairs.append((int(mine[qi]), int(theirs[ki])))
    return pairs


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_schedule_attends_every_causal_pair_once_with_equal_work(size):
    seq = 4 * size
    per_rank = [attended_pairs(rank, size, seq) for rank in range(size)]
    every = [pair for pairs in per_rank for pair in pairs]
    assert sorted(every) == [(q, k) for q in range(seq) for k in range(q + 1)]  # causal, none twice, none missed
    assert len({len(pairs) for pairs in per_rank}) == 1, [len(pairs) for pairs in per_rank]  # balanced
    ranks_blocks = [len(ring_schedule(rank, size, seq // size)) for rank in range(size)]
    assert ranks_blocks == [size] * size


# ------------------------------------------------------------------------------------------- attention


def full_attention(q, k, v, dout):
    """One causal SDPA over the whole sequence: (out, dq, dk, dv)."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def random_qkv_dout(seed: int, heads: int, groups: int, seq: int, dtype=torch.float32, batch: int = 2, dim: int = 8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, dim, generator=g, dtype=dtype)
    k, v = (torch.randn(batch, groups, seq, dim, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, torch.randn(batch, heads, seq, dim, generator=g, dtype=dtype)


@pytest.mark.parametrize("size,heads,groups", [(2, 4, 2), (3, 4, 4), (4, 4, 1)], ids=["cp2_gqa", "cp3_mha", "cp4_mqa"])
def test_blockwise_in_one_process_matches_full_attention(size, heads, groups):
    """The benchmark's single-process path: every rank's blocks one after another, no transfers (fp64)."""
    q, k, v, dout = random_qkv_dout(0, heads, groups, 12 * size, torch.float64)
    want = full_attention(q, k, v, dout)
    parts = [[split_sequence(x, 2, r, size) for x in (q, k, v, dout)] for r in range(size)]
    kvs = [torch.stack((k_, v_)) for _, k_, v_, _ in parts]
    scale = 1 / math.sqrt(q.shape[-1])
    forward = blockwise_forward([p[0] for p in parts], kvs, KERNELS["math"], scale)
    dqs, dkvs = blockwise_backward([p[3] for p in parts], [p[0] for p in parts], kvs, forward, KERNELS["math"], scale)
    for r in range(size):
        got = (forward[r][0], dqs[r], dkvs[r][0], dkvs[r][1])
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert rel_err(a, split_sequence(b, 2, r, size)) < 1e-12, (r, name)


class RecordingTransport(P2PTransport):
    """The p2p transport, recording the shape of every block it carries."""

    def __init__(self, group: GroupHandle):
        super().__init__(group)
        self.shapes: list[tuple[int, ...]] = []

    def open(self, num_steps, chunk_shape, dtype, device):
        self.shapes.append(tuple(chunk_shape))
        return super().open(num_steps, chunk_shape, dtype, device)


def ring_case() -> dict:
    """ring_attention on the world group, overlap off and on, against one full attention of the whole sequence."""
    size, rank = dist.get_world_size(), dist.get_rank()
    group = GroupHandle(ranks=list(range(size)), group=dist.group.WORLD, rank=rank, size=size)
    q, k, v, dout = random_qkv_dout(1, 4, 2, 8 * size)  # GQA: 2 key-value heads for 4 query heads
    want = full_attention(q, k, v, dout)
    results, shapes = {}, set()
    for overlap in (False, True):
        transport = RecordingTransport(group)
        local = [split_sequence(x, 2, rank, size).requires_grad_() for x in (q, k, v)]
        out = ring_attention(*local, CPComm(group, overlap, transport))
        out.backward(split_sequence(dout, 2, rank, size))
        results[overlap] = (out.detach(), *(x.grad for x in local))
        shapes |= set(transport.shapes)
    worst = max(rel_err(a, split_sequence(b, 2, rank, size)) for a, b in zip(results[True], want))
    same = all(torch.equal(a, b) for a, b in zip(results[False], results[True]))
    return {"worst": worst, "overlap_is_bitwise_serial": same, "shapes": sorted(shapes)}


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_full_attention(rank_pool, world):
    for report in rank_pool(world).run(ring_case):
        assert report["worst"] < TOL and report["overlap_is_bitwise_serial"], report
        # keys and values travel as (2, batch, key-value heads, local sequence, head dim): only the 2 KV heads
        assert report["shapes"] == [(2, 2, 2, 8, 8)], report


def gather_case() -> bool:
    """GatherSequence: whole sequences in order forward; backward keeps this rank's rows."""
    size, rank = dist.get_world_size(), dist.get_rank()
    comm = CPComm(GroupHandle(ranks=list(range(size)), group=dist.group.WORLD, rank=rank, size=size))
    whole_BS = torch.arange(3 * 8 * size, dtype=torch.float32).view(3, 8 * size)
    mine = split_sequence(whole_BS, 1, rank, size).flatten().requires_grad_()
    gathered = GatherSequence.apply(mine, 3, comm)
    (gathered * torch.arange(gathered.numel())).sum().backward()
    return (torch.equal(gathered, whole_BS.flatten())
            and torch.equal(mine.grad, split_sequence(torch.arange(whole_BS.numel()).view_as(whole_BS).float(), 1,
                                                      rank, size).flatten()))


def test_gather_sequence(rank_pool):
    assert all(rank_pool(4).run(gather_case))


# ----------------------------------------------------------------------------------------- the model


def cp_layout(cp: int, overlap: bool = False, **extra) -> dict:
    return {"parallel.context_parallel_size": cp, **({"overlap.cp_comm_overlap": "true"} if overlap else {}), **extra}


DIST_OPT = {"train.use_distributed_optimizer": "true", "overlap.overlap_grad_sync": "true",
            "overlap.overlap_param_sync": "true"}
# Both runs: an Adam eps above round-off, as test_master's TP cases and for the same reason: the ring sums the
# attention in another order (gradients agree to ~3e-7 after step 1), and Adam's first steps scale each element by
# its own magnitude, so with eps 1e-8 step 2 would compare the round-off of near-zero elements (1.9e-5 here).
BOTH = {"train.adam_eps": 1e-4}
TP_BOTH = {**BOTH, "model.num_query_groups": 4}  # TP=2 x 2 query groups per rank


@pytest.mark.parametrize("world,ep,both,layout", [
    (2, 1, BOTH, cp_layout(2)),
    (2, 1, {**BOTH, "model.moe_router_load_balancing_type": "seq_aux_loss"}, cp_layout(2, overlap=True)),
    (4, 1, BOTH, cp_layout(4)),
    (4, 1, BOTH, cp_layout(4, overlap=True)),
    (2, 2, {**BOTH, "model.moe_expert_capacity_factor": 1.0, "model.moe_token_drop_policy": "position"},
     cp_layout(2, overlap=True)),  # experts fold over the CP ranks; capacity drops by position
    (4, 2, TP_BOTH, {**tp_layout(2, "tp_comm_overlap_ag", "tp_comm_overlap_rs"), **cp_layout(2, overlap=True)}),
    (4, 2, BOTH, {**cp_layout(2, overlap=True), **DIST_OPT}),  # x DP=2: gradients reduced over dp_cp
], ids=["cp2", "cp2_overlap_seq_aux", "cp4", "cp4_overlap", "cp2_ep2_capacity", "cp2_tp2_sp_ep2",
        "cp2_dp2_ep2_distopt"])
def test_context_parallel_layouts_match_single_process(rank_pool, tmp_path, world, ep, both, layout):
    worst = rank_pool(world).run(equivalence_case, ep, 2, str(tmp_path), router=both, layout=layout)
    assert all(max(w.values()) < TOL for w in worst)


def wiring_case(output_dir: str) -> dict:
    """What a CP=2 training step moves: each rank reads half of every sequence, and each layer's attention passes
    its key-value heads around the ring (the equivalence above would also hold if every rank ran everything)."""
    cfg = small_config(output_dir, 2, 4, **cp_layout(2, overlap=True))
    _, mesh = world_and_mesh(cfg)
    try:
        trainer = Trainer(cfg, mesh, CPU)
        transport = RecordingTransport(mesh.cp)
        trainer.model.cp_comm.transport = transport  # one CPComm serves every layer
        input_ids, labels = trainer.sampler.micro_batches(0)[0]
        trainer.train_step()
        return {"tokens": list(input_ids.shape), "labels": list(labels.shape), "passes": len(transport.shapes),
                "shapes": sorted(set(transport.shapes))}
    finally:
        mesh.destroy()


def test_a_context_parallel_step_splits_the_data_and_runs_the_ring(rank_pool, tmp_path):
    for report in rank_pool(2).run(wiring_case, str(tmp_path)):
        assert report["tokens"] == report["labels"] == [2, 8], report  # micro-batch 2, seq 16 / CP 2
        # 3 layers x 2 micro-batches x (1 KV pass forward, 1 KV and 2 gradient passes backward)
        assert report["passes"] == 3 * 2 * 4, report
        assert report["shapes"] == [(2, 2, 2, 8, 8)], report  # (k|v, batch, 2 KV heads, local 8, head dim 8)


def test_context_parallel_with_recompute_matches_single_process(rank_pool, tmp_path):
    worst = rank_pool(2).run(equivalence_case, 2, 2, str(tmp_path), "full", router=BOTH,
                             layout=cp_layout(2, overlap=True))
    assert all(max(w.values()) < TOL for w in worst)


def test_checkpoint_moves_between_context_parallel_sizes(rank_pool, tmp_path):
    """Saved at CP=2 x EP=2 on 2 ranks, resumed at CP=1 (DP=2) and at CP=4: the same next loss."""
    cp2 = cp_layout(2, overlap=True)
    straight = rank_pool(2).run(run_and_save, str(tmp_path / "straight"), 2, 3, None, **cp2)[0]
    rank_pool(2).run(run_and_save, str(tmp_path / "moved"), 2, 2, 2, **cp2)
    for world, layout in ((2, {}), (4, cp_layout(4))):
        target = tmp_path / f"moved_{world}"
        target.mkdir()
        (target / "checkpoints").symlink_to(tmp_path / "moved" / "checkpoints")
        moved = rank_pool(world).run(run_and_save, str(target), 2, 3, None, **layout)[0]
        assert len(moved) == 1 and abs(moved[0] - straight[2]) / straight[2] < TOL, (world, moved, straight)


# --------------------------------------------------------------------------------------------- config


TINY_MOE = ["model.num_moe_experts=8"]


@pytest.mark.parametrize("overrides,field,fragment", [
    (["parallel.context_parallel_size=2", "model.seq_length=126"], "model.seq_length",
     "divisible by 2 x parallel.context_parallel_size=4"),
    (["parallel.context_parallel_size=2", "parallel.tensor_model_parallel_size=4", "parallel.sequence_parallel=true",
      "model.seq_length=4"], "model.seq_length", "context_parallel_size x tensor_model_parallel_size=8"),
    (["overlap.cp_comm_overlap=true"], "overlap.cp_comm_overlap", "no effect with parallel.context_parallel_size=1"),
    (["parallel.context_parallel_size=2", "parallel.cp_comm_type=all_gather"], "parallel.cp_comm_type",
     "not implemented yet"),
    (["parallel.context_parallel_size=2", *TINY_MOE, "overlap.moe_pipeline=true", "overlap.moe_planning=device",
      "train.moe_cuda_graph=true"], "train.moe_cuda_graph", "graphs of MoE layers under context parallelism"),
    (["parallel.context_parallel_size=0"], "parallel.context_parallel_size", "must be >= 1"),
    (["parallel.cp_comm_type=ring"], "parallel.cp_comm_type", "one of 'p2p'"),
], ids=["seq_vs_2cp", "seq_vs_cp_tp", "overlap_without_cp", "all_gather", "cuda_graph", "zero", "unknown_type"])
def test_bad_context_parallel_config_is_one_line(overrides, field, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert message.startswith(f"{field}=") and fragment in message and "\n" not in message, message


def test_world_size_must_hold_the_context_parallel_group():
    cfg = load_config(None, ["parallel.context_parallel_size=4"])
    with pytest.raises(ConfigError, match="world_size=6: must be divisible by tensor x context x pipeline"):
        validate_for_world(cfg, 6, "cpu")
    validate_for_world(cfg, 8, "cpu")  # CP=4 x DP=2
