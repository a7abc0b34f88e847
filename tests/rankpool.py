"""A pool of CPU gloo ranks per world size, started once per pytest session and reused by every case.

A torchrun job costs ~5.5 s to start; a pool pays process start-up and the gloo rendezvous once, after
which a multi-rank case costs only its own work. Cases are module-level functions, sent to the workers
by module name and qualified name (never by pickling code), so anything a test module defines at top
level runs on every rank; arguments and results travel pickled.

Any failure (an exception on some rank, a dead worker, a timeout) discards the whole pool: ranks that
did not fail may be stuck in a collective with one that did, and no later case should inherit that.
`get_pool` then starts a fresh one.

Nor may module state (a cache in a test module or the library) keep a process group past its destruction:
a destroyed gloo group still exchanges over its old connections, so a later case that picks the reference up
talks to a group its peers have left. It happened: a cache keyed by ``id(mesh)`` handed one rank the previous
case's EP group whenever CPython put the new mesh at the freed one's address on that rank only, and the
exchange waited out gloo's timeout, or not, by memory layout. A case after which a repository module still
reaches a destroyed process group fails, naming where.
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib
import importlib.util
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # registers multiprocessing's atexit hook before ours, so ours runs first
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TIMEOUT_S = 120.0
STARTUP_TIMEOUT_S = 60.0
# Once one rank has failed, the others get this long to report before they count as stuck.
FAILURE_GRACE_S = 1.0
# Gloo's own timeout outlasts the pool's, so a hang is reported by the pool, with the stuck stacks.
GLOO_TIMEOUT_MARGIN_S = 60.0
STACK_DUMP_WAIT_S = 1.0
# A failure report quotes at most this much of each failing rank's output.
OUTPUT_TAIL_CHARS = 20_000

# module name, qualified name, source file of the module (None when given as "module:qualname")
TaskSpec = tuple[str, str, str | None]

# Workers fork from a server that has imported torch once: starting a pool takes ~0.1 s instead of
# the 4-8 s that "spawn" needs on 2 cores (every worker importing torch at once). The server is a
# fresh interpreter that only imported torch, so workers start as clean as spawned ones.
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed"])


class RankPoolError(RuntimeError):
    """A case raised on some rank, a worker died, or results did not come back within the timeout."""


class RankPool:
    """`world_size` worker processes in one gloo process group, running cases as function calls."""

    def __init__(
        self,
        world_size: int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> None:
        import torch.distributed as dist

        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.broken = False
        self.pids: list[int] = []
        self._log_starts = [0] * world_size  # where each rank's log stood when the current case was sent
        self._conns: list[multiprocessing.connection.Connection] = []
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._log_dir = tempfile.TemporaryDirectory(prefix="rankpool-")
        # Only this process holds the write end: workers exit when it closes, even if this process is killed.
        lifeline_reader, self._lifeline = _CONTEXT.Pipe(duplex=False)
        gloo_timeout_s = timeout_s + GLOO_TIMEOUT_MARGIN_S
        # The parent holds the rendezvous store: port 0 lets the OS pick a free port, with no race.
        self._store = dist.TCPStore(
            "127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=gloo_timeout_s),
            wait_for_workers=False,
        )
        try:
            for rank in range(world_size):
                parent_end, child_end = _CONTEXT.Pipe()
                process = _CONTEXT.Process(
                    target=_worker_main,
                    args=(rank, world_size, self._store.port, gloo_timeout_s, child_end, lifeline_reader,
                          self._log_path(rank)),
                    name=f"rankpool-w{world_size}-r{rank}",
                )
                process.start()
                child_end.close()
                self._conns.append(parent_end)
                self._processes.append(process)
            self.pids = self._collect(startup_timeout_s, f"starting a {world_size}-rank pool")
        except BaseException:
            self._discard()
            raise
        finally:
            lifeline_reader.close()

    def run(self, fn: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; return the results ordered by rank.

        `fn` is a module-level function or a "module:qualname" string. Raises RankPoolError naming
        every rank that raised (with its traceback), died, or did not finish within `timeout_s`
        (with its Python stack), each with what it printed during the case; the pool is then discarded.
        """
        if self.broken:
            raise RankPoolError("this pool was discarded after a failure; get a fresh one from get_pool()")
        spec = _task_spec(fn)
        # Pickled here so that an unpicklable argument fails in the caller and leaves the pool intact.
        message = pickle.dumps((spec, pickle.dumps((args, kwargs))))
        self._log_starts = [self._log_size(rank) for rank in range(self.world_size)]
        try:
            for conn in self._conns:
                try:
                    conn.send_bytes(message)
                except OSError:
                    pass  # a dead worker: _collect reports it
            return self._collect(self.timeout_s, f"{spec[0]}:{spec[1]}")
        except BaseException:
            self._discard()  # also on KeyboardInterrupt: the workers are mid-case
            raise

    def close(self) -> None:
        """Let the workers leave their process group and exit; kill those that do not within 5 s."""
        for conn in self._conns:
            conn.close()  # a worker exits on end-of-file
        for process in self._processes:
            process.join(timeout=5.0)
        self._discard()

    def _collect(self, timeout_s: float, what: str) -> list[Any]:
        """Wait for one reply per rank; on any failure, discard the pool and raise a per-rank report."""
        deadline = time.monotonic() + timeout_s
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        pending = set(range(self.world_size))
        while pending and time.monotonic() < deadline:
            waitables = [self._conns[rank] for rank in pending] + [self._processes[rank].sentinel for rank in pending]
            multiprocessing.connection.wait(waitables, max(0.0, deadline - time.monotonic()))
            for rank in sorted(pending):
                conn, process = self._conns[rank], self._processes[rank]
                if conn.poll():
                    try:
                        ok, value = pickle.loads(conn.recv_bytes())
                    except EOFError:
                        failures[rank] = f"died: {_exit_description(process)}"
                    except Exception:
                        failures[rank] = f"returned a result the parent cannot unpickle:\n{traceback.format_exc()}"
                    else:
                        if ok:
                            results[rank] = value
                        else:
                            failures[rank] = f"raised:\n{value}"
                elif not process.is_alive():
                    failures[rank] = f"died: {_exit_description(process)}"
                else:
                    continue
                pending.discard(rank)
            if failures:
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        if not pending and not failures:
            return [results[rank] for rank in range(self.world_size)]
        self._dump_stacks(sorted(pending))
        for rank in pending:
            if failures:
                failures[rank] = f"stuck after another rank failed: no result {FAILURE_GRACE_S:g} s later"
            else:
                failures[rank] = f"timed out: no result after {timeout_s:g} s"
            failures[rank] += " (its stack is in its output)"
        summary = ", ".join(
            f"rank {rank} {'ok' if rank in results else failures[rank].split(':', 1)[0]}"
            for rank in range(self.world_size)
        )
        details = "\n".join(
            f"--- rank {rank} {failures[rank]}\n{self._output_since_case_start(rank)}" for rank in sorted(failures)
        )
        self._discard()
        raise RankPoolError(
            f"{what} failed on {self.world_size} ranks ({summary}); the pool was discarded.\n{details}"
        )

    def _dump_stacks(self, ranks: list[int]) -> None:
        """Have stuck workers write their Python stacks to their logs (faulthandler on SIGUSR1)."""
        sizes_before = {rank: self._log_size(rank) for rank in ranks}
        for rank in ranks:
            try:
                os.kill(self._processes[rank].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        while time.monotonic() < deadline and any(self._log_size(r) == sizes_before[r] for r in ranks):
            time.sleep(0.02)
        time.sleep(0.05)  # let a dump in progress finish

    def _output_since_case_start(self, rank: int) -> str:
        try:
            with open(self._log_path(rank), "rb") as log:
                log.seek(self._log_starts[rank])
                output = log.read().decode(errors="replace")
        except FileNotFoundError:  # the worker never got that far
            return "[no output]\n"
        if not output:
            return "[no output]\n"
        if len(output) > OUTPUT_TAIL_CHARS:
            output = f"[... {len(output) - OUTPUT_TAIL_CHARS} characters cut]\n{output[-OUTPUT_TAIL_CHARS:]}"
        return f"[output of rank {rank}]\n{output}"

    def _log_size(self, rank: int) -> int:
        try:
            return os.path.getsize(self._log_path(rank))
        except FileNotFoundError:
            return 0

    def _log_path(self, rank: int) -> str:
        return os.path.join(self._log_dir.name, f"rank{rank}.log")

    def _discard(self) -> None:
        """Kill every worker and release the pool's resources; idempotent."""
        self.broken = True
        for process in self._processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        self._processes, self._conns = [], []
        self._store = None
        self._lifeline.close()
        self._log_dir.cleanup()


_pools: dict[tuple[int, float], RankPool] = {}


def get_pool(world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> RankPool:
    """The session's pool for this world size and timeout; a fresh one if the last one was discarded."""
    key = (world_size, float(timeout_s))
    pool = _pools.get(key)
    if pool is None or pool.broken:
        pool = _pools[key] = RankPool(world_size, timeout_s)
    return pool


def shutdown_all() -> None:
    """Close every pool that get_pool started."""
    while _pools:
        _pools.popitem()[1].close()


atexit.register(shutdown_all)


def _task_spec(fn: Callable[..., Any] | str) -> TaskSpec:
    if isinstance(fn, str):
        module_name, _, qualname = fn.partition(":")
        if not module_name or not qualname:
            raise ValueError(f"expected 'module:qualname', got {fn!r}")
        return module_name, qualname, None
    module_name = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if module_name is None or qualname is None or "<" in qualname:
        raise TypeError(f"{fn!r} is not a module-level function; workers import cases by module and name")
    return module_name, qualname, getattr(sys.modules.get(module_name), "__file__", None)


def _exit_description(process: multiprocessing.process.BaseProcess) -> str:
    process.join(timeout=1.0)
    code = process.exitcode
    if code is not None and code < 0:
        return f"worker pid {process.pid} killed by {signal.Signals(-code).name}"
    return f"worker pid {process.pid} exited with exit code {code}"


def _worker_main(
    rank: int,
    world_size: int,
    store_port: int,
    gloo_timeout_s: float,
    conn: multiprocessing.connection.Connection,
    lifeline: multiprocessing.connection.Connection,
    log_path: str,
) -> None:
    """Join the process group, then run cases until the parent closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent decides
    threading.Thread(target=_exit_when_pool_closes, args=(lifeline,), daemon=True).start()
    # Output, C++ warnings, crash dumps and stacks on demand go to the log that failure reports quote.
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ["OMP_NUM_THREADS"] = "1"  # for anything a case launches; this process is set below
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.TCPStore(
            "127.0.0.1", store_port, world_size, is_master=False, timeout=timedelta(seconds=gloo_timeout_s)
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=gloo_timeout_s)
        )
    except BaseException:
        _send(conn, pickle.dumps((False, traceback.format_exc())))
        return
    _send(conn, pickle.dumps((True, os.getpid())))
    while True:
        try:
            spec, payload = pickle.loads(conn.recv_bytes())
        except EOFError:
            break
        try:
            fn = _resolve(spec)
            args, kwargs = pickle.loads(payload)  # after _resolve: arguments may be of classes in fn's module
            reply = pickle.dumps((True, fn(*args, **kwargs)))  # an unpicklable result fails here, on this rank
            kept = _destroyed_groups_in_module_state()
            if kept:
                raise RuntimeError(f"the case left destroyed process groups in module state, where a later case "
                                   f"would exchange over them: {', '.join(kept)}")
        except BaseException:
            reply = pickle.dumps((False, traceback.format_exc()))
        _send(conn, reply)
    dist.destroy_process_group()


def _destroyed_groups_in_module_state(max_depth: int = 6) -> list[str]:
    """Where the repository's modules (tests, library, benchmarks) still reach a destroyed process group: module
    globals, into containers and instances' attributes, ``max_depth`` levels deep."""
    import torch
    import torch.distributed as dist

    registered = dist.distributed_c10d._world.pg_map  # torch's live groups (private, in torch 2.11 and 2.13)
    skipped = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, torch.Tensor,
               str, bytes, int, float, bool, type(None))
    found: list[str] = []
    seen: set[int] = set()

    def visit(value: Any, where: str, depth: int) -> None:
        if isinstance(value, dist.ProcessGroup):
            if value not in registered:
                found.append(where)
            return
        if depth == 0 or isinstance(value, skipped) or id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, dict):
            for key, item in list(value.items()):
                visit(key, f"{where} key {key!r}", depth - 1)
                visit(item, f"{where}[{key!r}]", depth - 1)
        elif isinstance(value, (list, tuple, set, frozenset)):
            for index, item in enumerate(list(value)):
                visit(item, f"{where}[{index}]", depth - 1)
        elif isinstance(attributes := getattr(value, "__dict__", None), dict):
            for name, item in list(attributes.items()):
                visit(item, f"{where}.{name}", depth - 1)

    roots = tuple(str(REPO_ROOT / package) + os.sep for package in ("tests", "moe_overlap", "benchmarks"))
    for module in list(sys.modules.values()):
        if (getattr(module, "__file__", None) or "").startswith(roots):
            for name, value in list(vars(module).items()):
                visit(value, f"{module.__name__}.{name}", max_depth)
    return found


def _send(conn: multiprocessing.connection.Connection, reply: bytes) -> None:
    sys.stdout.flush()  # so that the log holds the case's output by the time the parent reads it
    sys.stderr.flush()
    conn.send_bytes(reply)


def _exit_when_pool_closes(lifeline: multiprocessing.connection.Connection) -> None:
    """Exit when the pool's owner closes the lifeline or dies, even while a case is stuck in a collective.

    The parent process is the forkserver, which outlives the owner while workers live, so it cannot tell.
    """
    try:
        lifeline.recv_bytes()
    finally:
        os._exit(1)


def _resolve(spec: TaskSpec) -> Callable[..., Any]:
    module_name, qualname, source_file = spec
    target: Any = _import(module_name, source_file)
    for attribute in qualname.split("."):
        target = getattr(target, attribute)
    return target


def _import(module_name: str, source_file: str | None) -> Any:
    """Import by name, or from the parent's file when the name does not lead there.

    pytest may name a test module in a way that sys.path alone cannot resolve (e.g. --import-mode=importlib).
    """
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if source_file is None or not (module_name == missing or module_name.startswith(missing + ".")):
            raise
    else:
        module_file = getattr(module, "__file__", None)
        if source_file is None or (module_file and os.path.samefile(module_file, source_file)):
            return module
    module_spec = importlib.util.spec_from_file_location(module_name, source_file)
    assert module_spec is not None and module_spec.loader is not None, f"cannot load {source_file}"
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    module_spec.loader.exec_module(module)
    return module
