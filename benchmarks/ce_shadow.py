"""What a copy-engine exchange of fixed slots could give the training step, measured before it is built.

    torchrun --nproc-per-node 2 benchmarks/ce_shadow.py configs/bench_fine_8l.yaml \\
        parallel.expert_model_parallel_size=2 ... --compute-only \\
        --variant "compute_only_ce:overlap.moe_pipeline=true,overlap.moe_compute_only=true" --json out.json

train_step.py's rows and JSON, with one addition: a row whose name ends in ``_ce`` runs with the copy engines
carrying, at each transfer of the device-planned exchange, the bytes that such an exchange would send: a whole slot
of a micro-batch's T tokens, at the transfer's row width, to each peer. The bytes go into a scratch buffer of
symmetric memory that nothing reads. Run on a ``compute_only`` row (every row stays on its rank; sizes and signals
still travel), that is the step of an exchange whose rows move by copy engines, with no SM pushing them. Each copy
runs on the transfer's own stream after compute_only lands its rows and before the transfer's signals, as a
copy-engine transport would copy and then signal, so a peer's wait covers it; CUDA graphs capture it with the
layer. The SM push it leaves out is what `benchmarks/peer_copy.py --sm-push-ctas` compares it with beside one GEMM.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import train_step  # noqa: E402

SLOT_EXTRA_COLUMNS = 128  # room past the hidden width for a wire row's extra columns (16-byte padded words)
_scratch: dict = {}  # the running ``_ce`` row's: workspace (peers' scratch), source (local bytes), tokens (T)


def _copying(land_own):
    def land_own_and_copy(self, src_RH, src_start, count, own_RH, land_start, land_count, ctas, gather=None):
        land_own(self, src_RH, src_start, count, own_RH, land_start, land_count, ctas, gather)
        if "workspace" not in _scratch:
            return
        nbytes = _scratch["tokens"] * own_RH.shape[1] * own_RH.element_size()
        if nbytes > _scratch["source"].numel():
            raise ValueError(f"a slot of {nbytes} bytes does not fit the {_scratch['source'].numel()}-byte scratch")
        for peer in (rank for rank in range(self.regions.size) if rank != self.regions.rank):
            _scratch["workspace"].view(peer, (nbytes,), _scratch["source"].dtype).copy_(
                _scratch["source"][:nbytes], non_blocking=True)
    return land_own_and_copy


def _allocating(init):
    def init_with_scratch(self, cfg, mesh, device, routing_replay=None):
        if _scratch.get("wanted"):  # before the trainer captures its graphs: they capture the copies
            import torch

            from moe_overlap.distributed.symm import SymmWorkspace

            tokens = cfg.train.micro_batch_size * cfg.model.seq_length
            nbytes = tokens * (cfg.model.hidden_size + SLOT_EXTRA_COLUMNS) * 4  # fp32 or bf16 rows
            _scratch.update(workspace=SymmWorkspace(mesh.ep.group, nbytes, device), tokens=tokens,
                            source=torch.zeros(nbytes, dtype=torch.uint8, device=device))
        init(self, cfg, mesh, device, routing_replay)
    return init_with_scratch


def _rows_with_copies(run_row):
    def run(name, overrides, args, out_dir, replay=None):
        _scratch.clear()
        _scratch["wanted"] = name.endswith("_ce")
        try:
            return run_row(name, overrides, args, out_dir, replay)
        finally:
            _scratch.clear()
            train_step.release_memory()
    return run


def main(argv=None) -> list[dict]:
    from moe_overlap.distributed.a2a_push import PushTransport
    from moe_overlap.training.trainer import Trainer

    PushTransport.land_own = _copying(PushTransport.land_own)
    Trainer.__init__ = _allocating(Trainer.__init__)
    train_step.run_row = _rows_with_copies(train_step.run_row)
    return train_step.main(argv)


if __name__ == "__main__":
    main()
