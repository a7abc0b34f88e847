"""The config's precision names (``train.precision``, ``overlap.grad_sync_dtype``) as torch dtypes."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
