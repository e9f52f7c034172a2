"""benchmarks/peer_trl.py's split of a run's time: the timed methods are counted once per outermost
call, the patches are undone, and a short project run reports every phase it went through."""
import time

import pytest

from benchmarks.peer_trl import PHASES, PhaseTimer, phase_split


class Worker:
    def outer(self):
        time.sleep(0.02)
        return self.inner() + 1

    def inner(self):
        time.sleep(0.01)
        return 1


def test_nested_timed_calls_count_once_and_patches_are_undone():
    w = Worker()
    originals = (Worker.outer, Worker.inner)
    timer = PhaseTimer()
    timer.wrap(Worker, "outer", "generation")
    timer.wrap(Worker, "inner", "training passes")
    timer.wrap(w, "inner", "reference pass")  # an instance attribute over the patched class's
    start = timer.snapshot()
    assert w.outer() == 2  # outer calls inner: counted inside outer only
    assert w.inner() == 1  # the instance's patch
    end = timer.snapshot()
    assert 0.03 <= end["generation"] - start["generation"] < 0.5
    assert end["training passes"] == start["training passes"]
    assert 0.01 <= end["reference pass"] - start["reference pass"] < 0.5
    timer.restore()
    assert (Worker.outer, Worker.inner) == originals and "inner" not in vars(w)
    split = phase_split(start, end, wall=0.1, tokens=1000)
    assert set(split) == {*PHASES, "everything else"}
    assert abs(sum(split.values()) - 100.0) < 1e-9  # microseconds per token of 0.1 s over 1,000 tokens



def test_a_call_inside_a_cuda_graph_capture_is_neither_synced_nor_timed(monkeypatch):
    """A device sync inside a capture would invalidate it (the static update captures the module's
    forward); the replay's time is the outer call's."""
    import benchmarks.peer_trl as peer

    syncs = []
    timer = PhaseTimer(sync=lambda: syncs.append(1))
    timer.wrap(Worker, "inner", "training passes")
    try:
        monkeypatch.setattr(peer, "capturing", lambda: True)
        assert Worker().inner() == 1 and not syncs and timer.snapshot()["training passes"] == 0
        monkeypatch.setattr(peer, "capturing", lambda: False)
        assert Worker().inner() == 1 and len(syncs) == 2 and timer.snapshot()["training passes"] > 0
    finally:
        timer.restore()


def test_a_project_run_reports_its_reward_by_iteration(capsys):
    """Runs of different speeds compared by the updates they made (every 100 iterations)."""
    from benchmarks.peer_trl import report

    curve = [(0.1 * i, i / 1000) for i in range(1, 251)]
    res = {"name": "project PPO", "steps": 250, "wall": 25.0, "warmup": 0.1, "tokens": 1000, "tok_s": 40.0,
           "timed_wall": 24.9, "first": 0.001, "final": 0.25, "best": 0.25, "curve": curve, "threads": 1,
           "cpu": {"own": 1.0, "machine": 1.0}}
    report(res, "iteration", 0.8)
    assert "  reward by iteration: (100, 0.100) (200, 0.200)\n" in capsys.readouterr().out


PROJECT_RUN = """
import json
from agents.config import load
from agents.modules.actor_critic import CausalLMActorCritic
from benchmarks.peer_trl import run_project

act = CausalLMActorCritic.act
cfg = load("tune_configs/quickstart.yaml", ["training.train_batch_size=512", "training.minibatch_size=256",
                                            "env_runners.num_envs_per_env_runner=16"])
res = run_project(cfg, seconds=3.0, threads=1)
print("RESULT", json.dumps({"phases": res["phases"], "restored": CausalLMActorCritic.act is act}))
"""


def test_a_short_project_run_splits_its_time_into_the_phases_it_ran():
    """In its own process: the run starts and stops its own Ray instance."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = subprocess.run([sys.executable, "-c", PROJECT_RUN], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.split("RESULT ", 1)[1])
    ph = res["phases"]
    assert ph["generation"] > 0 and ph["training passes"] > 0 and ph["reference pass"] > 0  # kl_coef > 0
    assert ph["everything else"] > 0
    assert res["restored"]  # the run's patches are undone


def test_ppo_profile_phases_split_nested_time_into_own_time():
    """benchmarks/ppo_profile.py: a phase's own time is its time outside the phases nested in it,
    a phase calling itself counts once, and the tree's rows add up."""
    from benchmarks.ppo_profile import Phases

    class Loop:
        def sample(self):
            time.sleep(0.01)
            return self.act() + self.act()

        def act(self, again=True):
            time.sleep(0.005)
            return self.act(False) if again else 1

    phases, loop = Phases(), Loop()
    phases.wrap(Loop, "sample", "sample")
    phases.wrap(Loop, "act", "act")
    assert loop.sample() == 2
    assert phases.calls["sample"] == 1 and phases.calls["act"] == 2  # the act inside act counts once
    assert phases.total["act"] >= 0.02 and phases.own["act"] == phases.total["act"]
    assert abs(phases.own["sample"] - (phases.total["sample"] - phases.total["act"])) < 1e-9
    assert 0.01 <= phases.own["sample"] < phases.total["sample"]


@pytest.mark.slow
def test_ppo_profile_times_every_phase_of_a_short_run_and_names_the_decode_path():
    """benchmarks/ppo_profile.py end to end on the CPU (as `gpu_checks.sh ppo_profile` runs it on a
    GPU), with decode blocks and the decode engine's graphs emulated on the CPU: every phase ran
    and took time, the own times add up to the iteration's, the profiler saw the torch ops of
    `act`, the decode path is named, and the ops outside the graphs are counted per phase."""
    import re

    from tests.conftest import run_module

    out = run_module("benchmarks.ppo_profile", "--iters", "2", "--profile-iters", "1", "--emulate-capture",
                     "--set", "training.train_batch_size=512", "--set", "training.minibatch_size=512",
                     "--set", "env_runners.decode_block=2", timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    host = out.stdout.split("== host clock", 1)[1].split("sampled tokens/s", 1)[0]
    rows = {m[1]: (float(m[2]), float(m[3]), float(m[6]))
            for m in re.finditer(r"^ +([a-z ]+?) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+)$", host, re.M)}
    assert set(rows) == {"iteration", "sample", "act", "env", "episodes", "update", "learner connector",
                         "training passes", "weight sync"}, host
    assert all(total > 0 and calls > 0 for total, _, calls in rows.values()), host
    own = sum(o for _, o, _ in rows.values())
    assert abs(own - rows["iteration"][0]) < 0.02 * rows["iteration"][0] + 0.05, host  # own times add up
    assert re.search(r"rollout path: decode block 2; RingKVCache on cpu .*decode engine 128 rows x \d+ columns, "
                     r"captured: \d+ graph\(s\), restarts in the static step", out.stdout), out.stdout
    ops = out.stdout.split("== ops outside", 1)[1].split("==", 1)[0]
    replays = float(re.search(r"([\d.]+) graph replays per iteration", ops)[1])
    counted = {m[1]: (float(m[2]), float(m[3])) for m in re.finditer(r"^ +([a-z ]+?) +([\d.]+) +([\d.]+)$", ops, re.M)}
    # 512 steps of 128 rows in blocks of 2: at least 2 blocks of 2 replays each; each replay's inputs are copied in
    assert replays >= 4 and counted["act"][0] > replays and counted["training passes"][0] > 0, ops
    assert counted["env"] == (0, 0) and counted["iteration"][0] == sum(o for _, o in counted.values()), ops
    act = re.search(r"^  act +(\d+) +(\d+) ", out.stdout.split("== torch.profiler", 1)[1], re.M)
    assert act and int(act[1]) > 0 and int(act[2]) > 0, out.stdout


def test_ppo_profile_table_marks_device_time_that_misses_graph_replays(capsys):
    """benchmarks/ppo_profile.py's profiler table: a phase's kernels add up to its device ms; a
    phase with a CUDA graph replay whose kernels the profiler did not link to it gets a "+",
    explained below the table (a replay with linked kernels is counted and gets none)."""
    from types import SimpleNamespace as Event

    from benchmarks.ppo_profile import profile_table

    act, passes = Event(name="act", cpu_parent=None), Event(name="training passes", cpu_parent=None)
    kernel = lambda us: Event(duration=us)  # noqa: E731
    events = [act, passes,
              Event(name="cudaLaunchKernel", cpu_parent=act, kernels=[kernel(1500.0)]),
              Event(name="cudaLaunchKernel", cpu_parent=act, kernels=[kernel(500.0)]),
              Event(name="cudaGraphLaunch", cpu_parent=passes, kernels=[]),
              Event(name="cudaGraphLaunch", cpu_parent=act, kernels=[kernel(250.0)])]  # linked: counted
    profile_table(Event(events=lambda: events), cuda=True)
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["act"][-1] == "2.25" and rows["act"][3] == "2"  # its ranges, ops, then two launches; a linked replay
    assert rows["training"][-1] == "0.00+" and rows["training"][-4] == "1"  # one replay
    assert "+: plus the kernels of the phase's CUDA graph replays" in out
