"""The Kubernetes manifests in docs/kubernetes against the API's own schemas (kubernetes-validate, strict:
an unknown or misplaced field fails), and the commands they run against ringllm's own parser."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from actors.cli import build_parser

kubernetes_validate = pytest.importorskip("kubernetes_validate")

MANIFESTS = sorted((Path(__file__).resolve().parent.parent / "docs" / "kubernetes").glob("*.yaml"))
VERSION = "1.33.0"


def resources() -> list[dict]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_every_manifest_holds_to_the_kubernetes_schemas():
    assert MANIFESTS
    for resource in resources():
        kubernetes_validate.validate(resource, VERSION, strict=True)


def test_a_misplaced_field_fails_the_check():
    deployment = next(r for r in resources() if r["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSION, strict=True)


def test_every_container_runs_a_command_ringllm_parses():
    for resource in resources():
        if resource["kind"] == "Deployment":
            for container in resource["spec"]["template"]["spec"]["containers"]:
                build_parser().parse_args(container["args"])
