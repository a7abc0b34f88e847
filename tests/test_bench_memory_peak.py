"""benchmarks/memory_peak.py: the peak of an allocator history and what is live then."""

from __future__ import annotations

from benchmarks.memory_peak import GIB, peak_of


def frames(*names: str) -> list[dict]:
    return [{"filename": f"/x/moe_overlap/{name.split(':')[0]}", "line": 1, "name": name.split(":")[1]}
            for name in names]


def test_peak_is_the_most_allocated_at_once_and_names_what_is_live_then():
    made_in_step = frames("layers/moe.py:forward", "training/trainer.py:launch_step", "training/trainer.py:fit")
    made_in_init = frames("layers/wgrad.py:placeholder", "training/trainer.py:__init__")
    trace = [
        {"action": "free_completed", "addr": 99, "size": 5 * GIB},  # its allocation fell out of the history
        {"action": "alloc", "addr": 1, "size": 2 * GIB, "frames": made_in_init},
        {"action": "alloc", "addr": 2, "size": 3 * GIB, "frames": made_in_step},
        {"action": "free_requested", "addr": 2, "size": 3 * GIB},
        {"action": "free_completed", "addr": 2, "size": 3 * GIB},
        {"action": "alloc", "addr": 3, "size": 1 * GIB, "frames": made_in_step},
        {"action": "alloc", "addr": 4, "size": 1 * GIB, "frames": made_in_step},
        {"action": "alloc", "addr": 5, "size": 2 * GIB, "frames": made_in_step},  # 6 GiB: the peak
        {"action": "free_completed", "addr": 5, "size": 2 * GIB},
        {"action": "alloc", "addr": 6, "size": 1 * GIB, "frames": made_in_step},
    ]
    summary = peak_of(trace)
    assert summary["peak_gib"] == 6.0 and summary["peak_event"] == 7
    assert summary["peak_reached_by"][0] == "fit"  # the outermost trainer frame
    live = {(made_in, made_by): (gib, count) for gib, count, made_in, made_by in summary["live_at_peak"]}
    assert live[("fit", "moe.py:1:forward < trainer.py:1:launch_step < trainer.py:1:fit")] == (4.0, 3)
    assert live[("__init__", "wgrad.py:1:placeholder < trainer.py:1:__init__")] == (2.0, 1)
    assert summary["live_groups"] == 2
