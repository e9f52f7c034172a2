"""Cluster configs are valid, and a job submitted to a real local Ray head trains and checkpoints."""
import glob
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from agents.serve.launch import free_port
from tests.conftest import ROOT
from tests.test_plugins import PLUGINS, plugin_experiment

CLUSTER = os.path.join(ROOT, "cluster")


def ray_version() -> str:
    text = open(os.path.join(ROOT, "requirements.txt")).read()
    return re.search(r"^ray\[[^\]]*\]==([\d.]+)$", text, re.M).group(1)


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml"])
def test_launcher_configs_pass_the_schema_shipped_with_ray(name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(open(os.path.join(CLUSTER, name)))
    validate_config(prepare_config(config))
    nodes = config["available_node_types"]
    assert nodes[config["head_node_type"]]["resources"] == {"CPU": 0}  # CPU head, no training work on it
    gpu = nodes["gpu_worker"]
    assert gpu["min_workers"] == 0 and gpu["max_workers"] >= 1
    assert any("pip install -e ~/rl-token-lm" in c for c in config["setup_commands"])  # the package and its requirements
    assert config["docker"]["image"].startswith(f"rayproject/ray:{ray_version()}-py311")
    # The check can fail: a misspelt key is refused by the same schema.
    import jsonschema

    gpu["max_wrkers"] = 3
    with pytest.raises(jsonschema.ValidationError, match="max_wrkers"):
        validate_config(prepare_config(config))


def _cluster_specs(doc):
    return doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]


@pytest.mark.parametrize("name", ["raycluster.yaml", "rayjob.yaml"])
def test_kuberay_manifests_have_the_required_fields_and_matching_versions(name):
    doc = yaml.safe_load(open(os.path.join(CLUSTER, "kuberay", name)))
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] in ("RayCluster", "RayJob")
    assert doc["metadata"]["name"]
    spec = _cluster_specs(doc)
    version = ray_version()
    assert spec["rayVersion"] == version
    assert spec["enableInTreeAutoscaling"] is True
    groups = [spec["headGroupSpec"]] + spec["workerGroupSpecs"]
    assert "rayStartParams" in spec["headGroupSpec"]
    for group in groups:
        containers = group["template"]["spec"]["containers"]
        assert containers and all(c["name"] and c["image"] for c in containers)
        for c in containers:
            assert re.fullmatch(rf"rayproject/ray:{re.escape(version)}-py311(-gpu)?", c["image"]), c["image"]
    for worker in spec["workerGroupSpecs"]:
        assert worker["groupName"] and "rayStartParams" in worker
        assert 0 <= worker["minReplicas"] <= worker["replicas"] <= worker["maxReplicas"]
        limits = worker["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) >= 1
    if doc["kind"] == "RayJob":
        config = doc["spec"]["entrypoint"].split("agents.train ")[1].split()[0]
        assert os.path.isfile(os.path.join(ROOT, config))
        assert "working_dir" in yaml.safe_load(doc["spec"]["runtimeEnvYAML"])


@pytest.mark.slow
def test_job_submitted_to_a_local_head_trains_and_leaves_a_checkpoint(tmp_path):
    """`ray start --head` on loopback, the Jobs API, the checked-in runtime env; token auth as Ray sets it up.
    The job is a user's project folder (`--working-dir`): a task and a reward of their own, by import path."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    import tempfile

    gcs, dashboard, agent, agent_grpc, metrics, runtime_env_agent, client_port = (free_port() for _ in range(7))
    temp_dir = tempfile.mkdtemp(prefix="rh", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    # The head's `python` is this environment's, as a cluster image's would be.
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    # `ray start --head` turns token auth on and keeps the token in ~/.ray/auth_token; clients send it.
    token_file = os.path.expanduser(os.environ.get("RAY_AUTH_TOKEN_PATH", "~/.ray/auth_token"))
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(
        [ray_bin, "start", "--head", "--block", f"--port={gcs}", "--node-ip-address=127.0.0.1",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", "--num-cpus=2", "--include-dashboard=true",
         # Own ports throughout, so another Ray instance on the machine (e.g. a test's ray.init) does not collide.
         f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
         f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={runtime_env_agent}",
         f"--ray-client-server-port={client_port}",
         f"--temp-dir={temp_dir}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        address = f"http://127.0.0.1:{dashboard}"
        client, last_error = None, None
        for _ in range(90):
            try:
                token = os.environ.get("RAY_AUTH_TOKEN") or open(token_file).read().strip()
                client = JobSubmissionClient(address, headers={"Authorization": f"Bearer {token}"})
                break
            except Exception as e:  # head still starting
                last_error = e
                if head.poll() is not None:
                    pytest.fail("ray start --head exited: " + head.stdout.read()[-2000:])
                time.sleep(1)
        assert client is not None, f"the head's Jobs API never came up: {last_error}"
        # The user's project folder: their own task and reward module and the experiment naming them.
        project = tmp_path / "project"
        project.mkdir()
        (project / "my_plugins.py").write_text(PLUGINS)
        config = plugin_experiment(project, "job")
        cfg = yaml.safe_load(open(config))
        storage = tmp_path / "results"
        cfg["tune"]["storage_path"] = str(storage)
        cfg["stop"]["training_iteration"] = 2
        (project / "plugins.yaml").write_text(yaml.safe_dump(cfg))
        runtime_env = yaml.safe_load(open(os.path.join(CLUSTER, "runtime_env.yaml")))
        runtime_env["working_dir"] = str(project)
        runtime_env["env_vars"]["HF_HUB_OFFLINE"] = "1"  # no network here
        entrypoint = "tokenmdp train plugins.yaml"
        job = None
        for _ in range(120):  # the node's job agent comes up a little after the dashboard
            try:
                job = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
                break
            except RuntimeError as e:
                if "No available agent" not in str(e):
                    raise
                time.sleep(1)
        assert job is not None, "the head never accepted the job"
        status = None
        for _ in range(300):
            status = client.get_job_status(job)
            if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
                break
            time.sleep(1)
        logs = client.get_job_logs(job)
        assert status == JobStatus.SUCCEEDED, logs[-3000:]
        assert "Summary (1 trial" in logs and "Ray dashboard: http://" in logs
        assert "Training PPO on task 'my_plugins:Reverse'" in logs
        assert glob.glob(str(storage / "job" / "*" / "checkpoint_*" / "learner_group")), logs[-2000:]
        assert glob.glob(str(storage / "job" / "*" / "events.out.tfevents.*"))
    finally:  # stop this head only (`ray stop` would stop every Ray instance on the machine)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(head.pid, sig)
                head.wait(timeout=60)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        import shutil

        shutil.rmtree(temp_dir, ignore_errors=True)
