"""benchmarks/layer_ops.py: the kernels a MoE layer call launches, counted on CPU (interpreted Triton)."""

import json

from benchmarks import layer_ops


def test_layer_ops_counts_what_each_path_launches(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "ops.json"
    layer_ops.main(["--tokens", "16", "--hidden", "32", "--ffn", "16", "--experts", "8", "--topk", "4",
                    "--json", str(out)])
    rows = {row["variant"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"local", "device_sm_push_once", "device_sm_push"}
    local, once = rows["local"], rows["device_sm_push_once"]
    for row in rows.values():
        for phase in ("forward", "backward"):
            assert row[phase]["launches"] == sum(row[phase]["by_op"].values()) > row[phase]["triton"] > 0
    # the pipeline plans, pushes and expands: more launches than the local path, the push among them
    assert once["forward"]["launches"] > local["forward"]["launches"]
    assert once["forward"]["by_op"].get("triton:_push_rows_kernel", 0) >= 1
    assert "triton:_push_rows_kernel" not in local["forward"]["by_op"]
