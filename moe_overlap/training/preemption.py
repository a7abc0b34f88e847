"""Stopping a run cleanly: SIGTERM / SIGINT and ``train.exit_duration_min``.

A signal only records a request; the training loop asks :meth:`StopRequests.agreed` before it queues a step, and the
ranks agree on it (a max all-reduce over a CPU group of the world), so every rank finishes the same step, saves the same
checkpoint and exits 0, whichever rank the signal reached. A second signal ends the process at once (exit code 128 + the
signal's number) unless it comes within ``DUPLICATE_WINDOW_S`` of the first: launchers relay a signal (torchrun forwards
the one it gets; a scheduler may signal the launcher and the ranks alike), so one request can arrive twice. The signals
are read from Python's signal wakeup fd by a thread, which sees the second one even while the main thread is blocked in
a collective or a device wait.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

DUPLICATE_WINDOW_S = 1.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequests:
    """Signal handlers and the time limit for the duration of a ``with`` block (on the main thread; elsewhere
    only the time limit applies)."""

    def __init__(self, exit_duration_min: float | None, device: torch.device, rank: int = 0):
        self.device, self.rank = device, rank
        self.deadline = None if exit_duration_min is None else time.monotonic() + 60 * exit_duration_min
        self.exit_duration_min = exit_duration_min
        self.signal_number = 0  # the first signal's, once one came
        self._first_at: float | None = None  # when the reader saw it
        self._previous: dict[int, object] = {}
        self._pipe: tuple[int, int] | None = None
        self._previous_wakeup_fd = -1
        self._reader: threading.Thread | None = None

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is not threading.main_thread():
            return self
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # set_wakeup_fd needs it
        self._pipe = (read_fd, write_fd)
        for number in SIGNALS:
            self._previous[number] = signal.signal(number, self._record)
        self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd)
        self._reader = threading.Thread(target=self._read_signals, args=(read_fd,), daemon=True,
                                        name="moe-overlap-signals")
        self._reader.start()
        return self

    def __exit__(self, *exc) -> bool:
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            for number, handler in self._previous.items():
                signal.signal(number, handler)
            os.close(self._pipe[1])  # the reader sees end-of-file and ends
            self._reader.join(timeout=5)
            os.close(self._pipe[0])
            self._pipe = None
        return False

    def _read_signals(self, read_fd: int) -> None:
        while data := os.read(read_fd, 64):
            for number in data:
                if number in SIGNALS:
                    self._on_signal(signal.Signals(number))

    def _record(self, signum: int, frame) -> None:
        """The Python-level handler (main thread, between bytecodes): the request, for the next check."""
        self.signal_number = self.signal_number or signum

    def _on_signal(self, sig: signal.Signals) -> None:
        """The reader thread's view, which a blocked main thread cannot delay: the notice, and the exit on a
        second signal."""
        now = time.monotonic()
        if self._first_at is None:
            self.signal_number, self._first_at = self.signal_number or int(sig), now
            if self.rank == 0:
                print(f"moe-overlap: {sig.name}: finishing the step in hand, then saving a checkpoint and stopping "
                      "(a second signal exits at once, without saving)", file=sys.stderr, flush=True)
        elif now - self._first_at >= DUPLICATE_WINDOW_S:
            print(f"moe-overlap: rank {self.rank}: second {sig.name}: exiting now without saving",
                  file=sys.stderr, flush=True)
            os._exit(128 + int(sig))

    def agreed(self, group) -> str | None:
        """Why to stop now, the same on every rank, or None: the first signal's name, or the time limit. A
        collective over ``group``, a CPU (gloo) group spanning every rank: the host asks it between queueing
        steps without waiting for the GPU work already queued."""
        timed_out = self.deadline is not None and time.monotonic() >= self.deadline
        flags = torch.tensor([self.signal_number, int(timed_out)], dtype=torch.int64)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        signal_number, timed_out = flags.tolist()
        if signal_number:
            return signal.Signals(signal_number).name
        return f"train.exit_duration_min={self.exit_duration_min:g}" if timed_out else None
