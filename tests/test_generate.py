"""`python -m agents.generate`'s command line: a wrong flag or --checkpoint is refused in one
line before torch, transformers or RLlib are imported. `assert_refused_lightly` and
`run_directory` serve the same checks of `agents.evaluate` and `agents.export`
(tests/test_evaluate.py, tests/test_export.py)."""
import os
import subprocess
import sys

from agents.saved_policy import MODULE_SUBDIR
from tests.conftest import ROOT

HEAVY = ("fastapi", "ray", "torch", "transformers")
# `python -m MODULE ARGS...` as `python -c PROBE MODULE ARGS...`, then, at exit, which of HEAVY it imported
PROBE = ("import atexit, runpy, sys; "
         f"atexit.register(lambda: print(sorted(set({HEAVY!r}) & set(sys.modules)))); "
         "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")


def assert_refused_lightly(module: str, cases: list[tuple[list, str]]) -> None:
    """Runs `python -m module *argv` for every case's argv at once (from the repository root,
    offline), and checks that each exits 2 with its error line (the whole of stderr; after the usage
    lines for an error of argparse's, "PROG: error: ...", given as its start), having imported none
    of HEAVY."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", PROBE, module, *map(str, argv)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for argv, _ in cases]
    for (argv, expected), proc in zip(cases, procs):
        out, err = proc.communicate(timeout=120)
        err = err.strip().splitlines()
        assert proc.returncode == 2, (argv, err)
        if expected.startswith("error:"):
            assert err == [expected], (argv, err)
        else:
            assert err[-1].startswith(expected) and not any("Traceback" in line for line in err), (argv, err)
        assert out.strip().splitlines()[-1:] == ["[]"], (argv, out)  # the HEAVY modules it imported


def run_directory(tmp_path) -> tuple[str, str]:
    """A run (trial) directory holding one checkpoint with a policy file, and that checkpoint."""
    checkpoint = tmp_path / "run" / "checkpoint_000001"
    (checkpoint / MODULE_SUBDIR).mkdir(parents=True)
    (checkpoint / MODULE_SUBDIR / "module_state.pt").write_bytes(b"")
    return str(tmp_path / "run"), str(checkpoint)


def test_generate_refuses_a_wrong_checkpoint_or_flag_in_one_line_before_importing_torch(tmp_path):
    missing = tmp_path / "missing"
    run, checkpoint = run_directory(tmp_path)
    cases = [
        (["--checkpoint", missing], f"error: --checkpoint: {missing} holds no policy (looked for {MODULE_SUBDIR})"),
        (["--checkpoint", run],
         f"error: --checkpoint: {run} is a run directory, not a checkpoint; its newest checkpoint is {checkpoint}"),
        (["--checkpoint", checkpoint, "--precision", "fp16"],
         "error: --precision: expected one of fp32, bf16, got 'fp16'"),
        (["--checkpoint", checkpoint, "--device", "tpu"], "error: --device: expected cpu or cuda[:N], got 'tpu'"),
        (["--checkpoint", checkpoint, "-n", "-1"],
         "python -m agents.generate: error: -n: expected an integer in [1, 1000]"),
    ]
    assert_refused_lightly("agents.generate", cases)
