"""Storage faults: a save that cannot write (a file-size limit, as a full disk) fails on every rank with one line
and stops the run, keeping the previous checkpoint even under keep_last=1; a truncated or corrupt newest
checkpoint is caught by its manifest at resume, set aside, and the previous one used, with a warning naming
both. (A crash in the middle of a save is in test_fault.py: the survivors name it, `latest` stays.)
"""

from __future__ import annotations

import json

from moe_overlap.cli import main
from tests.faults import fault_case
from tests.long_run import latest, logged_losses, train_argv, uninterrupted_losses


def test_full_disk_fails_the_save_clearly_and_keeps_the_only_good_checkpoint(rank_pool, tmp_path):
    reference = uninterrupted_losses(rank_pool, tmp_path / "reference")
    run, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    results = rank_pool(2).run(fault_case, train_argv(run, "checkpoint.keep_last=1"), "diskfull:1:4")
    assert [code for code, _ in results] == [4, 4], results
    line = results[0][1].strip().splitlines()[-1]
    # DCP writes through torch.save, which reports the failed write as a short one ("unexpected pos")
    assert line.startswith("moe-overlap: checkpoint error: checkpoint save of step 4 to "
                           f"{checkpoints / 'step_00000004'} "
                           "failed on rank 1: RuntimeError: ") and "GiB free there)" in line and line.endswith(
        f"the newest complete checkpoint, {checkpoints / 'step_00000002'}, is kept"), line
    assert results[1][1].strip() == "" or "moe-overlap" not in results[1][1]  # one line, from rank 0
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000002"]  # no partial directory
    code, text = rank_pool(2).run(fault_case, train_argv(run, "checkpoint.keep_last=1"))[0]
    assert code == 0, text
    assert logged_losses(run) == reference
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000008"]


def test_truncated_and_corrupt_newest_checkpoints_fall_back_to_the_previous(rank_pool, tmp_path):
    reference = uninterrupted_losses(rank_pool, tmp_path / "reference")
    run, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    code, text = rank_pool(2).run(fault_case, train_argv(run, "checkpoint.keep_last=3"))[0]
    assert code == 0 and latest(run)["step"] == 8, text
    newest, previous = checkpoints / "step_00000008", checkpoints / "step_00000006"
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated
    size = shard.stat().st_size
    data = bytearray((previous / "rank_00001.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # corrupt, same size
    (previous / "rank_00001.pt").write_bytes(bytes(data))
    code, text = rank_pool(2).run(fault_case, train_argv(run, "train.max_steps=8"))[0]
    assert code == 0, text
    fallback = checkpoints / "step_00000004"
    assert (f"checkpoint {newest} is damaged: {shard.name} holds {size} bytes, the manifest says {size + 100} "
            f"(truncated?); moved to step_00000008.damaged; using {fallback} instead") in text, text
    assert (f"checkpoint {previous} is damaged: rank_00001.pt fails its CRC-32 check (corrupt); moved to "
            f"step_00000006.damaged; using {fallback} instead") in text, text
    assert f"resumed from {fallback} at step 4" in text
    assert logged_losses(run) == reference  # steps 5-8 ran again, onto the same curve
    assert (checkpoints / "step_00000008.damaged" / shard.name).is_file()  # set aside, never deleted
    manifest = json.loads((checkpoints / "step_00000008" / "manifest.json").read_text())  # the new step 8
    assert manifest["step"] == 8 and {".metadata", "rank_00000.pt", "rank_00001.pt"} <= set(manifest["files"])


def test_only_damaged_checkpoints_fail_the_resume_clearly(tmp_path, capsys):
    argv = train_argv(tmp_path, "parallel.expert_model_parallel_size=1", "train.max_steps=2")
    assert main(argv) == 0
    (tmp_path / "checkpoints" / "step_00000002" / "rank_00000.pt").write_bytes(b"")
    capsys.readouterr()
    assert main(argv[:-1] + ["train.max_steps=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"moe-overlap: config error: checkpoint.dir='{tmp_path / 'checkpoints'}': holds only damaged "
                       "checkpoints, now moved to step_N.damaged; restore them, or run again to start from step 0")
    assert (tmp_path / "checkpoints" / "step_00000002.damaged").is_dir()
