"""The Kubernetes manifests in docs/kubernetes against the API's own schemas (kubernetes-validate, strict:
an unknown or misplaced field fails), and the commands they run against ringllm's own parser. A
LeaderWorkerSet is a custom resource no schema package covers: its pod templates are held to the
PodTemplate schema, and its own fields to those of LWS's v1 API."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from actors.cli import build_parser

kubernetes_validate = pytest.importorskip("kubernetes_validate")

MANIFESTS = sorted((Path(__file__).resolve().parent.parent / "docs" / "kubernetes").glob("*.yaml"))
VERSION = "1.33.0"
LWS = "LeaderWorkerSet"
# leaderworkerset.x-k8s.io/v1: the fields of LeaderWorkerSetSpec and LeaderWorkerTemplate, and its restart policies
LWS_SPEC = {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"}
LWS_TEMPLATE = {
    "leaderTemplate",
    "workerTemplate",
    "size",
    "restartPolicy",
    "subGroupPolicy",
    "volumeClaimTemplates",
    "persistentVolumeClaimRetentionPolicy",
}
LWS_RESTARTS = {"RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"}
# what Kubernetes puts in place of $(VAR) in a container's args, as LWS or the container's env would give it
EXPANDED = {"MODEL_DIR": "/models/m", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "ringllm-tp-0.ringllm-tp"}


def resources() -> list[dict]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def pod_templates(resource: dict) -> Iterator[dict]:
    if resource["kind"] == "Deployment":
        yield resource["spec"]["template"]
    elif resource["kind"] == LWS:
        template = resource["spec"]["leaderWorkerTemplate"]
        yield from (template[key] for key in ("leaderTemplate", "workerTemplate") if key in template)


def test_every_manifest_holds_to_the_kubernetes_schemas():
    assert MANIFESTS
    kinds = set()
    for resource in resources():
        kinds.add(resource["kind"])
        if resource["kind"] != LWS:
            kubernetes_validate.validate(resource, VERSION, strict=True)
            continue
        assert resource["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        spec = resource["spec"]
        template = spec["leaderWorkerTemplate"]
        assert set(spec) <= LWS_SPEC and set(template) <= LWS_TEMPLATE and template["restartPolicy"] in LWS_RESTARTS
        for pods in pod_templates(resource):
            kubernetes_validate.validate(
                {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": pods}, VERSION, strict=True
            )
    assert {"Deployment", LWS} <= kinds


def test_a_misplaced_field_fails_the_check():
    deployment = next(r for r in resources() if r["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSION, strict=True)


def test_every_container_runs_a_command_ringllm_parses():
    nodes = []
    for resource in resources():
        for pods in pod_templates(resource):
            for container in pods["spec"]["containers"]:
                args = [re.sub(r"\$\((\w+)\)", lambda m: EXPANDED[m[1]], arg) for arg in container["args"]]
                parsed = build_parser().parse_args(args)
                if parsed.command == "serve" and parsed.nnodes > 1:
                    nodes.append(parsed.node_rank)
    assert nodes  # the LeaderWorkerSet's
