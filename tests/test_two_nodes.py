"""Two Ray nodes on this machine (`ray start --head` and `ray start --address`, loopback): a PPO job
submitted with `ray job submit --working-dir .` runs its EnvRunners on the worker node (pinned there
by a custom resource, `env_runners.custom_resources`) and learns; the worker node is killed mid-run,
a replacement node joins, and the run goes on with its EnvRunners restarted there, no iteration lost.
Then the same head takes a user's project folder as a job (its own task and reward).

One job makes the first three tests' observations (a two-node run costs minutes on 2 cores); each
test checks one part of it."""
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
import yaml

from agents.serve.launch import free_port
from tests.conftest import ROOT

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
RESOURCE = "rollout_node"  # only worker nodes have it; each EnvRunner asks for 1
KILL_AT = 5  # the worker node is killed when this iteration is printed
STEPS = 40_000  # the run stops after this many sampled env steps (iterations without samples do not count)


def _env() -> dict:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1",
           "RAY_AUTH_MODE": "token",  # `ray start --head` turns token auth on; the other nodes and clients send it
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    env.pop("RAY_ADDRESS", None)
    return env


def _agent_ports() -> list[str]:
    # Own ports throughout, so other Ray instances on the machine (a test's ray.init) do not collide.
    return [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}"]


class Node:
    """`ray start --block` in its own session: killing its process group is losing the node."""

    def __init__(self, *args: str):
        # A node's own temp dir, as on its own machine (Ray's socket paths must stay under 107 bytes);
        # nodes sharing one would share their session's runtime_resources (the job's working_dir).
        self.temp_dir = tempfile.mkdtemp(prefix="rn", dir="/tmp")
        self.proc = subprocess.Popen([RAY, "start", "--block", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                                      "--object-store-memory=300000000", f"--temp-dir={self.temp_dir}",
                                      *_agent_ports(), *args],
                                     env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)

    def env_runners(self) -> dict[int, str]:
        """pid -> (working directory, whether agents/train.py is there) of the EnvRunner processes on this node."""
        out = {}
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                try:
                    if "EnvRunner" in " ".join(p.cmdline()):
                        cwd = p.cwd()
                        out[p.pid] = (cwd, os.path.isfile(os.path.join(cwd, "agents", "train.py")))
                except psutil.NoSuchProcess:
                    pass
        except psutil.NoSuchProcess:
            pass
        return out

    def kill(self, sig=signal.SIGKILL):
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self):
        self.kill()  # a test's node: no draining (its workers go with its raylet)
        self.proc.wait(timeout=30)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _iterations(logs: str) -> list[tuple[int, int, float | None]]:
    """(iteration, sampled env steps, reward or None) of each progress line."""
    rows = []
    for it, steps, reward in re.findall(r"^iter +(\d+) +steps +([\d,]+) +reward +([\d.]+|n/a)", logs, re.M):
        rows.append((int(it), int(steps.replace(",", "")), None if reward == "n/a" else float(reward)))
    return rows


@pytest.fixture(scope="module")
def two_node_job(tmp_path_factory):
    """Runs the job (killing the worker node at iteration KILL_AT and starting a replacement) and
    returns what was seen: logs, status, EnvRunners per node before and after, the nodes' roots."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    tmp = tmp_path_factory.mktemp("two_nodes")
    gcs, dashboard = free_port(), free_port()
    head = Node("--head", f"--port={gcs}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                f"--dashboard-port={dashboard}", f"--ray-client-server-port={free_port()}")
    nodes = [head]
    try:
        worker = Node(f"--address=127.0.0.1:{gcs}", f"--resources={{\"{RESOURCE}\": 2}}")
        nodes.append(worker)
        address = f"http://127.0.0.1:{dashboard}"
        token_file = os.path.expanduser(os.environ.get("RAY_AUTH_TOKEN_PATH", "~/.ray/auth_token"))
        client = None
        for _ in range(120):
            try:
                token = os.environ.get("RAY_AUTH_TOKEN") or open(token_file).read().strip()
                client = JobSubmissionClient(address, headers={"Authorization": f"Bearer {token}"})
                break
            except Exception:  # head still starting
                assert head.proc.poll() is None, "ray start --head exited"
                time.sleep(1)
        assert client is not None, "the head's Jobs API never came up"

        runtime_env = yaml.safe_load(open(os.path.join(ROOT, "cluster", "runtime_env.yaml")))
        runtime_env["env_vars"]["HF_HUB_OFFLINE"] = "1"  # no network here
        (tmp / "runtime_env.yaml").write_text(yaml.safe_dump(runtime_env))
        # the quickstart at 16 rows and 2,048-step batches: about 20 iterations in the step budget
        sets = ["env_runners.num_env_runners=2", "env_runners.num_cpus_per_env_runner=0.5",
                "env_runners.num_envs_per_env_runner=16", "training.train_batch_size=2048",
                "training.minibatch_size=512",
                f"env_runners.custom_resources.{RESOURCE}=1", f"stop.num_env_steps_sampled_lifetime={STEPS}",
                "stop.training_iteration=null", "stop.episode_return_mean=null", "stop.time_total_s=null",
                "checkpoint.frequency=5", f"tune.storage_path={tmp / 'results'}", "tune.name=two_nodes",
                "generate.num_samples=0"]
        entrypoint = ["python", "-m", "agents.train", "tune_configs/quickstart.yaml", *sum((["--set", s] for s in sets), [])]
        job = None
        for _ in range(60):  # the head's job agent comes up a little after the dashboard
            out = subprocess.run([RAY, "job", "submit", f"--address={address}", "--working-dir", ".",
                                  "--runtime-env", str(tmp / "runtime_env.yaml"), "--no-wait", "--", *entrypoint],
                                 cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
            m = re.search(r"Job '(\S+)' submitted successfully", out.stdout + out.stderr)
            if m:
                job = m.group(1)
                break
            assert "No available agent" in out.stdout + out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
            time.sleep(1)
        assert job is not None, "the head never accepted the job"

        seen = {"before": {}, "head_before": {}, "after": {}, "killed_at_steps": None, "outage": []}
        replacement = None
        status, logs = None, ""
        deadline = time.time() + 900
        while time.time() < deadline:
            status = client.get_job_status(job)
            logs = client.get_job_logs(job)
            rows = _iterations(logs)
            if replacement is None and rows and rows[-1][0] >= KILL_AT:
                seen["before"], seen["head_before"] = worker.env_runners(), head.env_runners()
                seen["killed_at"] = rows[-1][0]
                seen["killed_at_steps"] = rows[-1][1]
                worker.kill()  # the node is lost: its raylet, agents and EnvRunners
                # Iterations go on without samples until a node with the resource joins.
                while time.time() < deadline and not [r for r in _iterations(client.get_job_logs(job))
                                                      if r[0] > seen["killed_at"]]:
                    time.sleep(1)
                replacement = Node(f"--address=127.0.0.1:{gcs}", f"--resources={{\"{RESOURCE}\": 2}}")
                nodes.append(replacement)
            if replacement is not None and rows and rows[-1][1] > seen["killed_at_steps"]:  # sampling again
                now = replacement.env_runners()
                if len(now) >= len(seen["after"]):
                    seen["after"] = now
            if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
                break
            time.sleep(1)
        yield {"status": status, "logs": logs, "storage": tmp / "results" / "two_nodes", **seen,
               "head": head, "worker": worker, "replacement": replacement, "client": client}
    finally:
        for node in reversed(nodes):  # these nodes only (`ray stop` would stop every Ray instance here)
            node.stop()


@pytest.mark.slow
def test_ppo_learns_with_its_env_runners_on_the_worker_node(two_node_job):
    run = two_node_job
    assert run["before"], "no EnvRunner process on the worker node: " + run["logs"][-3000:]
    assert len(run["before"]) == 2 and not run["head_before"], (run["before"], run["head_before"])
    rewards = [r for _, _, r in _iterations(run["logs"]) if r is not None]
    first, last = rewards[0], sum(rewards[-3:]) / 3
    assert first < 0.45 and last > first + 0.1, rewards


@pytest.mark.slow
def test_losing_the_worker_node_mid_run_loses_no_iteration(two_node_job):
    from ray.job_submission import JobStatus

    run = two_node_job
    logs = run["logs"]
    assert run["status"] == JobStatus.SUCCEEDED, logs[-3000:]
    rows = _iterations(logs)
    its = [it for it, _, _ in rows]
    assert its == list(range(1, len(its) + 1)), its  # every iteration once, in order: none lost, none repeated
    killed = run["killed_at"]
    steps = {it: s for it, s, _ in rows}
    # Some iteration after the loss had no EnvRunner to sample from.
    assert any(steps[i + 1] == steps[i] for i in range(killed, its[-1])), rows
    assert steps[its[-1]] >= STEPS > steps[killed], rows  # sampling came back and reached the budget
    # The EnvRunners were restarted on the node that joined, not on the head.
    assert len(run["after"]) == 2 and not set(run["after"]) & set(run["before"]), run["after"]
    assert "Summary (1 trial" in logs and "FAILED" not in logs
    assert glob.glob(str(run["storage"] / "*" / "checkpoint_*" / "learner_group"))


@pytest.mark.slow
def test_the_job_ships_the_working_dir_to_the_worker_nodes(two_node_job):
    """`--working-dir .`: the EnvRunners on both worker nodes run in the job's copy of this repository."""
    run = two_node_job
    runners = [*run["before"].values(), *run["after"].values()]
    assert len(runners) == 4, runners
    for cwd, has_code in runners:
        assert "runtime_resources" in cwd and "working_dir_files" in cwd and has_code, cwd
    assert "Training PPO on task 'increasing_numbers'" in run["logs"]


@pytest.mark.slow
def test_a_users_project_folder_submitted_as_a_job_trains_with_its_own_task_and_reward(two_node_job, tmp_path):
    """The same head (`ray start --head` on loopback, the Jobs API, token auth as Ray sets it up) takes
    a second job: a user's project folder as its `working_dir`, with the checked-in runtime env, a
    task and a reward of their own named by import path, run with the `tokenmdp` command."""
    from ray.job_submission import JobStatus

    from tests.test_plugins import PLUGINS, plugin_experiment

    client = two_node_job["client"]
    assert two_node_job["status"] == JobStatus.SUCCEEDED, "the first job did not end: it holds the head's CPU"
    project = tmp_path / "project"
    project.mkdir()
    (project / "my_plugins.py").write_text(PLUGINS)
    config = plugin_experiment(project, "job")
    cfg = yaml.safe_load(open(config))
    storage = tmp_path / "results"
    cfg["tune"]["storage_path"] = str(storage)
    cfg["stop"]["training_iteration"] = 2
    (project / "plugins.yaml").write_text(yaml.safe_dump(cfg))
    runtime_env = yaml.safe_load(open(os.path.join(ROOT, "cluster", "runtime_env.yaml")))
    runtime_env["working_dir"] = str(project)
    runtime_env["env_vars"]["HF_HUB_OFFLINE"] = "1"  # no network here
    job = client.submit_job(entrypoint="tokenmdp train plugins.yaml", runtime_env=runtime_env)
    status = None
    for _ in range(300):
        status = client.get_job_status(job)
        if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            break
        time.sleep(1)
    logs = client.get_job_logs(job)
    if status not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        client.stop_job(job)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    assert "Summary (1 trial" in logs and "Ray dashboard: http://" in logs
    assert "Training PPO on task 'my_plugins:Reverse'" in logs
    assert glob.glob(str(storage / "job" / "*" / "checkpoint_*" / "learner_group")), logs[-2000:]
    assert glob.glob(str(storage / "job" / "*" / "events.out.tfevents.*"))
