"""moe_overlap: Mixtral-style mixture-of-experts training where communication hides under computation."""

__version__ = "0.1.0"
