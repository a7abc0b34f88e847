"""Faults injected into a real training run, for the long-run tests (the product has no fault hooks).

``python tests/faults.py CLI-ARGS...`` is the moe-overlap command line with the faults of MOE_OVERLAP_TEST_FAULT
installed, "KIND:RANK:STEP" items separated by commas, in the first torchrun attempt only
(TORCHELASTIC_RESTART_COUNT 0 or unset). :func:`fault_case` does the same on a rank of the test pool, for the
faults a process survives. Kinds:
  start       SIGKILL at the start of STEP
  forward     SIGKILL inside the forward of STEP (the last decoder layer's pre-hook): the peers are mid-step
  collective  sleep 1 s, then SIGKILL, just before the gradient reduction of STEP: the peers wait in it
  save        SIGKILL in the save of STEP, after the DCP shards and before this rank's own file
  block       block forever at the start of STEP, in a wait that neither returns nor fails (as a device-side
              symmetric-memory wait does): only the monitor can end this rank
  symm        SIGKILL at the first symmetric-memory row push of STEP (GPU, device-planned MoE pipeline): the
              peers wait on its signal on the device
  slow        sleep 30 s at the start of STEP, saying so on stderr (a long step, for the second-signal test)
  sigterm     send SIGTERM to this process after STEP (a preemption notice)
  latejoin    sleep STEP seconds before the command starts (a rank slow to start: imports, CUDA, a read)
  nan         NaN in this rank's reduced gradient of layers.1.mlp.experts.w2 at STEP
  diskfull    the save of STEP writes into a 4 KiB file-size limit (RLIMIT_FSIZE: every larger write fails
              with EFBIG, as on a full disk)
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from moe_overlap import cli  # noqa: E402
from moe_overlap.layers.param_info import param_info  # noqa: E402
from moe_overlap.training.trainer import Trainer  # noqa: E402

NAN_PARAM = "layers.1.mlp.experts.w2"
_ORIGINALS = (Trainer.launch_step, Trainer.save, torch.save)


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(kind: str, step: int) -> None:
    """Patch the trainer (and torch.save) so that ``kind`` strikes at ``step`` in this process; :func:`undo`
    restores them."""
    launch_step, save, torch_save = Trainer.launch_step, Trainer.save, torch.save

    def faulty_launch_step(self, *args, **kwargs):
        if self.step + 1 != step:  # not the step about to run
            return launch_step(self, *args, **kwargs)
        if kind == "start":
            _die()
        elif kind == "forward":
            list(self.model.layers.values())[-1].register_forward_pre_hook(lambda *a: _die())
        elif kind == "collective":
            self.optimizer.reduce_grads = lambda: (time.sleep(1.0), _die())
        elif kind == "block":
            threading.Event().wait()
        elif kind == "symm":
            from moe_overlap.distributed.a2a import PushTransport
            PushTransport.move = lambda *a, **k: _die()  # peers then wait for its rows on the GPU
        elif kind == "slow":
            print(f"faults: step {step} sleeps 30 s", file=sys.stderr, flush=True)
            time.sleep(30)
        elif kind == "nan":
            reduce = self.optimizer.reduce_grads

            def reduce_then_poison():
                reduce()
                param_info(dict(self.model.named_parameters())[NAN_PARAM]).main_grad.fill_(float("nan"))
                self.optimizer.reduce_grads = reduce
            self.optimizer.reduce_grads = reduce_then_poison
        launched = launch_step(self, *args, **kwargs)
        if kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        return launched

    def faulty_save(self, *args, **kwargs):
        if kind != "diskfull" or self.step != step:
            return save(self, *args, **kwargs)
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a core-dumping signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
        try:
            return save(self, *args, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
            signal.signal(signal.SIGXFSZ, previous)

    def faulty_torch_save(obj, f, *args, **kwargs):
        if kind == "save" and f"step_{step:08d}.tmp" in str(f):
            _die()
        return torch_save(obj, f, *args, **kwargs)

    Trainer.launch_step, Trainer.save, torch.save = faulty_launch_step, faulty_save, faulty_torch_save


def undo() -> None:
    Trainer.launch_step, Trainer.save, torch.save = _ORIGINALS


def install_from(spec: str, rank: int) -> None:
    for item in filter(None, spec.split(",")):
        kind, fault_rank, step = item.split(":")
        if int(fault_rank) == rank:
            install(kind, int(step))


def fault_case(argv: list[str], spec: str = "") -> tuple[int, str]:
    """A rank-pool case: ``moe-overlap`` with ``argv`` and the faults of ``spec`` on this rank; returns the
    exit code and what it printed and logged."""
    import torch.distributed as dist

    install_from(spec, dist.get_rank())
    captured = io.StringIO()
    root, handler = logging.getLogger(), logging.StreamHandler(captured)
    level = root.level
    root.addHandler(handler)  # before cli.main, whose logging.basicConfig then leaves the root logger alone
    root.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
            code = cli.main(argv)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        undo()
    return code, captured.getvalue()


def join_late(spec: str, rank: int) -> None:
    for item in filter(None, spec.split(",")):
        kind, fault_rank, seconds = item.split(":")
        if kind == "latejoin" and int(fault_rank) == rank:
            time.sleep(int(seconds))


if __name__ == "__main__":
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0:
        spec, rank = os.environ.get("MOE_OVERLAP_TEST_FAULT", ""), int(os.environ.get("RANK", 0))
        join_late(spec, rank)
        install_from(",".join(item for item in spec.split(",") if not item.startswith("latejoin:")), rank)
    raise SystemExit(cli.main(sys.argv[1:]))
