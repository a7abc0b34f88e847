"""Makes test modules importable as `tests.<name>`, the name multi-rank workers import cases by."""
