"""overlap.moe_dispatch_once_per_rank: each token crosses to an EP rank once per chunk (layers/wire_rows.py)."""

from __future__ import annotations

import pytest

from tests.test_moe_layer import moe_cases


def test_smoke(rank_pool):
    settings = [dict(planning=p, chunks=c, once_per_rank=True) for p in ("host", "device") for c in (1, 2)]
    errors = rank_pool(2).run(moe_cases, "sparse", 2, settings)
    assert max(max(e) for e in errors) < 1e-5
