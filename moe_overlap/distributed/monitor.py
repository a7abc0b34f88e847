"""Which rank is gone, and what it was doing: heartbeats and phases in the rendezvous store.

Every rank publishes a heartbeat counter and its phase ("train step 7", "checkpoint save of step 6") in the
store its process group rendezvoused through (keys under a per-run prefix), and a thread watches the next rank
in a ring. A rank whose heartbeat stands still for ``stale_s`` (half of train.distributed_timeout_s, at most
30 s) without having said that it finished is gone: its watcher writes one failure record, and every rank that
reads it prints one line naming that rank and its phase, and exits with code 3, whatever its main thread is
blocked in (a collective, or a device-side symmetric-memory wait, which no collective timeout interrupts). A
rank that ends on an error of its own records it first, so the others name that error instead. A store that
no longer answers means that the process hosting it is gone: rank 0 without torchrun, else torchrun's agent.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid

import torch.distributed as dist

from moe_overlap.distributed.collectives import default_store

EXIT_PEER_FAILED = 3
_FAILURE = "failure"


class RankMonitor:
    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float, prefix: str):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.prefix = prefix
        self.stale_s = min(timeout_s / 2, 30.0)
        self.interval_s = min(max(self.stale_s / 5, 0.05), 5.0)
        self.current_phase = "startup"
        self._failure: str | None = None
        self._failed = threading.Event()
        self._main_thread_reports = False  # set while the main thread waits to report a failure itself
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="moe-overlap-monitor")

    @classmethod
    def start(cls, timeout_s: float) -> RankMonitor | None:
        """Start watching on every rank (a collective); None in a single process."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        holder = [f"moe_overlap/monitor/{uuid.uuid4().hex}/"]
        dist.broadcast_object_list(holder, src=0)  # one prefix per run: a reused store holds older runs' keys
        monitor = cls(default_store(), dist.get_rank(), dist.get_world_size(), timeout_s, holder[0])
        monitor.phase("startup")
        monitor._thread.start()
        return monitor

    def _key(self, kind: str, rank: int | None = None) -> str:
        return f"{self.prefix}{kind}" if rank is None else f"{self.prefix}{kind}/{rank}"

    def phase(self, text: str) -> None:
        """What this rank does now, for the others' messages should it die."""
        self.current_phase = text
        try:
            self.store.set(self._key("phase", self.rank), text)
        except Exception:  # a store that does not answer is the watcher thread's to report
            pass

    def finish(self, outcome: str = "done") -> None:
        """Stop watching; ``outcome`` ("done", or this rank's own error) is what the others see."""
        self._stop.set()
        try:
            self.store.set(self._key("state", self.rank), outcome)
        except Exception:
            pass
        self._thread.join(timeout=2 * self.interval_s + 1)

    def wait_for_failure(self) -> str | None:
        """After this rank's collective failed: the failure record (which rank, in which phase), once the
        watchers have found it, or None if none appears within the staleness window."""
        with self._lock:
            self._main_thread_reports = True
        self._failed.wait(self.stale_s + 3 * self.interval_s)
        return self._failure

    def exit_line(self, text: str) -> str:
        return f"moe-overlap: rank {self.rank} (in {self.current_phase}): {text}"

    # ------------------------------------------------------------------------------- the watcher thread
    def _watch(self) -> None:
        peer = (self.rank + 1) % self.world_size
        last_beat, last_change = -1, time.monotonic()
        while not self._stop.wait(self.interval_s):
            try:
                self.store.add(self._key("heartbeat", self.rank), 1)
                if self.store.check([self._key(_FAILURE)]):
                    self._fail(self.store.get(self._key(_FAILURE)).decode())
                    return
                beat = self.store.add(self._key("heartbeat", peer), 0)
                now = time.monotonic()
                if beat != last_beat:
                    last_beat, last_change = beat, now
                    continue
                if now - last_change < self.stale_s:
                    continue
                state = self._read(self._key("state", peer))
                if state == "done":
                    continue  # it finished normally; the run is ending
                where = self._read(self._key("phase", peer)) or "startup"
                text = (f"rank {peer} stopped on an error (in {where}): {state}" if state else
                        f"rank {peer} is gone: no heartbeat for {now - last_change:.0f} s (it was in {where})")
                self._fail(self.store.compare_set(self._key(_FAILURE), "", text).decode())  # the first record wins
                return
            except Exception as err:
                if self._stop.is_set():
                    return
                host = ("torchrun's agent" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                        else "rank 0, which hosts it,")
                self._fail(f"the rendezvous store does not answer ({type(err).__name__}: "
                           f"{' '.join(str(err).split())[:200]}): {host} is gone")
                return

    def _let_peers_read_it(self) -> None:
        """Count this rank as having read the failure record; the rank hosting the store (rank 0 without torchrun)
        then waits, a few polls at most, until every other live rank has read it too: a host that left at once
        made a third rank blame the host instead of the rank that failed (4xH100, tests/test_gpu_fault.py)."""
        try:
            seen = self.store.add(self._key("seen"), 1)
            if self.rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                return
            deadline = time.monotonic() + 2 * self.interval_s + 1
            while seen < self.world_size - 1 and time.monotonic() < deadline:  # the failed rank never reads it
                time.sleep(self.interval_s / 4)
                seen = self.store.add(self._key("seen"), 0)
        except Exception:  # the store itself is gone: nothing to wait for
            pass

    def _read(self, key: str) -> str | None:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _fail(self, text: str) -> None:
        self._let_peers_read_it()
        with self._lock:
            self._failure = text
            self._failed.set()
            if self._main_thread_reports:
                return
        print(self.exit_line(f"{text}; exiting"), file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_FAILED)  # the main thread may be blocked where nothing else would wake it
