"""`python -m moe_overlap ...` (also `torchrun ... -m moe_overlap train CONFIG`) is the `moe-overlap` CLI."""

from moe_overlap.cli import main

raise SystemExit(main())
