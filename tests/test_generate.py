"""`python -m agents.generate`'s command line: a wrong flag or --checkpoint is refused in one
line before torch, transformers or RLlib are imported (`tests.conftest.assert_refused_lightly`,
which serves the same checks of agents.evaluate, agents.export and agents.serve)."""
from agents.saved_policy import MODULE_SUBDIR
from tests.conftest import assert_refused_lightly, run_directory


def test_generate_refuses_a_wrong_checkpoint_or_flag_in_one_line_before_importing_torch(tmp_path):
    missing = tmp_path / "missing"
    run, checkpoint = run_directory(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["--checkpoint", missing], f"error: --checkpoint: {missing}: no such directory"),
        (["--checkpoint", empty], f"error: --checkpoint: {empty} holds no policy (looked for {MODULE_SUBDIR})"),
        (["--checkpoint", run],
         f"error: --checkpoint: {run} is a run directory, not a checkpoint; its newest checkpoint is {checkpoint}"),
        (["--checkpoint", checkpoint, "--precision", "fp16"],
         "error: --precision: expected one of fp32, bf16, got 'fp16'"),
        (["--checkpoint", checkpoint, "--device", "tpu"], "error: --device: expected cpu or cuda[:N], got 'tpu'"),
        (["--checkpoint", checkpoint, "--seed", "-1"], "error: --seed: expected an integer in [0, 2147483647], got -1"),
        (["--checkpoint", checkpoint, "-n", "-1"],
         "python -m agents.generate: error: -n: expected an integer in [1, 1000]"),
    ]
    assert_refused_lightly("agents.generate", cases)
