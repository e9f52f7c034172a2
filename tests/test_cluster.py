"""Cluster configs are valid (a job submitted to a real local Ray head: tests/test_two_nodes.py)."""
import os
import re

import pytest
import yaml

from tests.conftest import ROOT

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
