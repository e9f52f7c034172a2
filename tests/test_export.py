"""`python -m agents.export`'s command line: a wrong --checkpoint, --out or flag is refused in one
line before torch or transformers are imported (`agents.export` imports `agents.generate`, which
imports them in the functions that need them). Exports themselves: tests/test_serve.py,
tests/test_lora.py and tests/test_module.py."""
from agents.saved_policy import MODULE_SUBDIR
from tests.conftest import assert_refused_lightly, run_directory


def test_export_refuses_a_wrong_checkpoint_out_or_flag_in_one_line_before_importing_torch(tmp_path):
    missing, out = tmp_path / "missing", tmp_path / "out"
    run, checkpoint = run_directory(tmp_path)
    (tmp_path / "afile").write_text("x")
    cases = [
        (["--checkpoint", missing, "--out", out],
         f"error: --checkpoint: {missing}: no such directory"),
        (["--checkpoint", run, "--out", out],
         f"error: --checkpoint: {run} is a run directory, not a checkpoint; its newest checkpoint is {checkpoint}"),
        (["--checkpoint", checkpoint, "--out", tmp_path / "afile"],
         f"error: --out: {tmp_path / 'afile'} exists and is not a directory"),
        (["--checkpoint", checkpoint, "--out", out, "--lora", "both"],
         "python -m agents.export: error: argument --lora: invalid choice: 'both'"),
    ]
    assert_refused_lightly("agents.export", cases)
    assert not out.exists()
