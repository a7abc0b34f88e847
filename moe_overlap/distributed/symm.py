"""The one owner of symmetric-memory buffers and signals (torch.distributed._symmetric_memory).

A workspace is one registered buffer per group and purpose, allocated once; peers' buffers are reachable
as ordinary tensors, so a copy into them is a peer-to-peer copy-engine transfer that takes no SMs.
Signals are one-slot semaphores per (peer, channel): ``signal`` sets the peer's slot, ``wait`` consumes
ours; both are stream-ordered and every wait has a non-zero timeout (torch's default, 0, waits forever).
NVLink multicast is never used: a handle that reports a multicast pointer is refused.
"""

from __future__ import annotations

import math
import os
import warnings
import weakref

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_MS = 60_000
_LIVE_WORKSPACES: "weakref.WeakSet[SymmWorkspace]" = weakref.WeakSet()


def symmetric_memory_bytes() -> int:
    """Bytes of this process's live symmetric-memory workspaces: allocated outside torch's caching allocator, so
    ``torch.cuda.max_memory_allocated`` does not see them."""
    return sum(workspace.nbytes for workspace in _LIVE_WORKSPACES)


def symm_unavailable_reason(group: dist.ProcessGroup | None, device: torch.device) -> str | None:
    """Why the copy-engine transport cannot run here, or None when it can."""
    if device.type != "cuda":
        return f"symmetric memory needs CUDA tensors; the device is {device.type}"
    if group is None:
        return "the group has one rank: nothing to exchange"
    if dist.get_backend(group) != "nccl":
        return f"the process group's backend is {dist.get_backend(group)!r}, not nccl"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as err:
        return f"torch.distributed._symmetric_memory is missing ({err})"
    ranks = dist.get_process_group_ranks(group)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count()))
    hosts = {r // local for r in ranks}
    if len(hosts) > 1:
        return f"the group's ranks {ranks} span {len(hosts)} hosts (LOCAL_WORLD_SIZE={local}); peer copies need one"
    me = torch.cuda.current_device()
    for peer in range(torch.cuda.device_count()):
        if peer != me and not torch.cuda.can_device_access_peer(me, peer):
            return f"GPU {me} has no peer access to GPU {peer}"
    return None


def choose_transport(field: str, requested: str, allowed: tuple[str, ...], collective: str, group_ranks: list[int],
                     local_world_size: int, symm_reason: str | None) -> tuple[str, str]:
    """The transport to use for config ``field`` and why: ``symm`` or the process group's ``collective`` one.
    ``symm_reason`` says why symmetric memory cannot run (None: it can).

    auto: symm when every rank of the group shares one host with peer access, ``collective`` otherwise.
    Asking for a transport that cannot run is an error that says why.
    """
    if requested not in allowed:
        raise ValueError(f"{field}={requested!r}: allowed {', '.join(allowed)}")
    hosts = {r // max(local_world_size, 1) for r in group_ranks}
    if len(hosts) > 1 and symm_reason is None:
        symm_reason = f"the ranks {group_ranks} span {len(hosts)} hosts (LOCAL_WORLD_SIZE={local_world_size})"
    if requested == "auto":
        if symm_reason is None:
            return "symm", "every rank of the group shares one host with peer access"
        return collective, f"symm cannot run: {symm_reason}"
    if requested == "symm" and symm_reason is not None:
        raise ValueError(f"{field}='symm' cannot run: {symm_reason}; use 'auto' or '{collective}'")
    if requested not in ("symm", collective):
        raise ValueError(f"{field}={requested!r} cannot run here; use '{collective}'")
    return requested, "requested"


def fill_finite(buffer_B: torch.Tensor) -> torch.Tensor:
    """A new byte buffer's contents as small finite numbers (bf16 pairs, so fp32 views are finite too), from a
    private generator: no region starts as whatever the memory held (every exchange, compute-only ones too, writes
    each row it reads; tests/test_compute_only.py fills NaN bytes here instead to check that)."""
    generator = torch.Generator(buffer_B.device).manual_seed(0)
    buffer_B[:buffer_B.numel() // 2 * 2].view(torch.bfloat16).normal_(generator=generator)
    return buffer_B


class SymmWorkspace:
    """A registered buffer of ``nbytes`` on every rank of ``group`` (a collective: all ranks construct it)."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device,
                 timeout_ms: int = DEFAULT_TIMEOUT_MS):
        import torch.distributed._symmetric_memory as symm_mem

        if timeout_ms <= 0:
            raise ValueError(f"timeout_ms={timeout_ms}: must be > 0 (0 waits forever)")
        self.group, self.timeout_ms = group, timeout_ms
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        with warnings.catch_warnings():  # deprecated in newer torch, still required by 2.11
            warnings.simplefilter("ignore")
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(group.group_name)
        self.nbytes = nbytes
        self.buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        _LIVE_WORKSPACES.add(self)
        self.handle = symm_mem.rendezvous(self.buffer, group.group_name)
        if getattr(self.handle, "multicast_ptr", 0):
            raise RuntimeError("symmetric memory came with an NVLink multicast pointer; set "
                               "TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (multicast must stay off on shared hosts)")
        # Every rank's signal pad is zeroed before any peer may raise a signal in it: a pad the allocator hands on
        # from a freed workspace may still hold the signals its last releases raised, which no claim consumed.
        pad_words = self.handle.signal_pad_size // 4
        self.handle.get_signal_pad(self.rank, (pad_words,), torch.int32).zero_()
        torch.cuda.synchronize(device)
        dist.barrier(group)

    def view(self, rank: int, shape: tuple[int, ...], dtype: torch.dtype, offset_bytes: int = 0) -> torch.Tensor:
        """``rank``'s buffer (this rank's own when rank == self.rank) as a tensor of ``shape`` at an offset."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset_bytes % itemsize:
            raise ValueError(f"offset {offset_bytes} is not a multiple of the {dtype} item size {itemsize}")
        end = offset_bytes + math.prod(shape) * itemsize
        if end > self.nbytes:
            raise ValueError(f"a view ending at byte {end} does not fit the {self.nbytes}-byte workspace")
        return self.handle.get_buffer(rank, tuple(shape), dtype, offset_bytes // itemsize)

    def signal(self, peer: int, channel: int) -> None:
        """Set ``peer``'s semaphore ``channel`` for us, on the current stream (after its earlier work)."""
        self.handle.put_signal(peer, channel=channel, timeout_ms=self.timeout_ms)

    def wait(self, peer: int, channel: int) -> None:
        """Block the current stream until ``peer`` signalled ``channel``, then clear it; times out loudly."""
        self.handle.wait_signal(peer, channel=channel, timeout_ms=self.timeout_ms)

    def barrier(self, channel: int = 0) -> None:
        self.handle.barrier(channel=channel, timeout_ms=self.timeout_ms)


class SymmRegions:
    """One workspace cut into ``count`` equal regions that successive exchanges use in turn, with the flow
    control every copy-engine transport needs (a collective: all ranks construct it).

    A rank writes into a peer's region only after that peer said the region is free: ``claim`` makes a
    stream wait for every peer's "free" signal for the next region, which each raises in ``release`` once
    everything that read it is done (and once here, at start-up). Every rank claims and releases each
    region once per use, so a free signal is always consumed before it is raised again. Data signals have a
    channel per (region, step): a raise into a slot not yet consumed would spin until it is and tie
    unrelated exchanges together across streams.
    """

    def __init__(self, group: dist.ProcessGroup, region_bytes: int, count: int, steps: int, device: torch.device,
                 timeout_ms: int = DEFAULT_TIMEOUT_MS):
        self.region_bytes = -(-region_bytes // 256) * 256  # every region 256-byte aligned
        self.count, self.steps, self.next = count, steps, 0
        self.workspace = SymmWorkspace(group, self.region_bytes * count, device, timeout_ms)
        self.rank, self.size = self.workspace.rank, self.workspace.size
        self.peers = [p for p in range(self.size) if p != self.rank]
        self.buffer_ptrs = list(self.workspace.handle.buffer_ptrs)  # every rank's workspace, mapped here
        fill_finite(self.workspace.buffer)  # before any peer may write (the free signals below)
        for region in range(count):
            for peer in self.peers:
                self.workspace.signal(peer, region)

    def claim(self, stream: torch.cuda.Stream) -> int:
        """The next region; ``stream``'s later work runs once every peer has freed it."""
        region, self.next = self.next, (self.next + 1) % self.count
        with torch.cuda.stream(stream):
            for peer in self.peers:
                self.workspace.wait(peer, region)
        return region

    def release(self, region: int) -> None:
        """On the current stream, after every read of the region: peers may write into it again."""
        for peer in self.peers:
            self.workspace.signal(peer, region)

    def view(self, rank: int, region: int, shape: tuple[int, ...], dtype: torch.dtype,
             offset_bytes: int = 0) -> torch.Tensor:
        """``rank``'s copy of ``region`` as a tensor, from ``offset_bytes`` into the region."""
        if offset_bytes + math.prod(shape) * torch.empty((), dtype=dtype).element_size() > self.region_bytes:
            raise ValueError(f"a view of {tuple(shape)} {dtype} at byte {offset_bytes} does not fit a "
                             f"{self.region_bytes}-byte region")
        return self.workspace.view(rank, shape, dtype, region * self.region_bytes + offset_bytes)

    def data_channel(self, region: int, step: int) -> int:
        if not 0 <= step < self.steps:
            raise ValueError(f"step {step} outside the regions' {self.steps} data channels")
        return self.count + region * self.steps + step

    def signal(self, peer: int, region: int, step: int) -> None:
        self.workspace.signal(peer, self.data_channel(region, step))

    def wait(self, peer: int, region: int, step: int) -> None:
        self.workspace.wait(peer, self.data_channel(region, step))


class LocalRegions:
    """:class:`SymmRegions` for a group of one rank: the regions in ordinary device memory, no peers, so no
    signals. A transport over it moves rows within the process (the pipeline's own cost, measured on one GPU)."""

    def __init__(self, region_bytes: int, count: int, steps: int, device: torch.device):
        self.region_bytes = -(-region_bytes // 256) * 256
        self.count, self.steps, self.next = count, steps, 0
        self.rank, self.size, self.peers = 0, 1, []
        self.buffer = fill_finite(torch.empty(self.region_bytes * count, dtype=torch.uint8, device=device))
        self.buffer_ptrs = [self.buffer.data_ptr()]

    def claim(self, stream) -> int:
        region, self.next = self.next, (self.next + 1) % self.count
        return region

    def release(self, region: int) -> None:
        pass

    def view(self, rank: int, region: int, shape: tuple[int, ...], dtype: torch.dtype,
             offset_bytes: int = 0) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if offset_bytes + nbytes > self.region_bytes:
            raise ValueError(f"a view of {tuple(shape)} {dtype} at byte {offset_bytes} does not fit a "
                             f"{self.region_bytes}-byte region")
        start = region * self.region_bytes + offset_bytes
        return self.buffer[start:start + nbytes].view(dtype).view(shape)
