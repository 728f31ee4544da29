"""The deployment files run as written: ops/compose.yaml passes `docker compose config`,
ops/Dockerfile copies what the package needs, ops/k8s/ passes the Kubernetes schemas (KEDA's
ScaledObject: the keys its CRD requires), and every command they start is one sdq has."""

import os
import re
import shlex
import subprocess
import tomllib
from dataclasses import fields
from importlib.metadata import version
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner

from sdq.models.jobs.kinds import KINDS, MAINTENANCE_QUEUE, POOL_QUEUES, Pool
from sdq.producer.cli.main import main
from tests.conftest import ROOT

OPS = ROOT / "ops"
KUBERNETES_VERSION = "1.30"
# Where settings are declared: the generic ones, and each kind's group beside the kind.
SETTINGS_SOURCE = "".join(path.read_text() for path in (ROOT / "models").rglob("settings.py"))

# KEDA's triggers sdq scales on: a queue's length, a Prometheus query. KEDA reads trigger
# metadata as strings.
REDIS_TRIGGER = {
    "type": "object",
    "required": ["type", "metadata"],
    "properties": {
        "type": {"const": "redis"},
        "metadata": {
            "type": "object",
            "required": ["listName", "listLength"],
            "additionalProperties": False,
            "properties": {
                "address": {"type": "string"},
                "listName": {"type": "string"},
                "listLength": {"type": "string", "pattern": "^[0-9]+$"},
            },
        },
    },
}
PROMETHEUS_TRIGGER = {
    "type": "object",
    "required": ["type", "metadata"],
    "properties": {
        "type": {"const": "prometheus"},
        "metadata": {
            "type": "object",
            "required": ["serverAddress", "query", "threshold"],
            "additionalProperties": False,
            "properties": {
                "serverAddress": {"type": "string", "pattern": "^https?://"},
                "query": {"type": "string"},
                "threshold": {"type": "string", "pattern": "^[0-9]+$"},
            },
        },
    },
}
# The part of KEDA's ScaledObject CRD that sdq relies on (keda.sh/v1alpha1).
SCALED_OBJECT = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": {"type": "string"}},
                },
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {"oneOf": [REDIS_TRIGGER, PROMETHEUS_TRIGGER]},
                },
            },
        },
    },
}


def assert_sdq_command(args: list[str]) -> None:
    """What a container runs is a command sdq has, with options it takes."""
    shown = CliRunner().invoke(main, [*args, "--help"])
    assert shown.exit_code == 0, f"sdq {shlex.join(args)}: {shown.output}"


def assert_known_settings(names: list[str]) -> None:
    unknown = [name for name in names if name.startswith("SDQ_") and name not in SETTINGS_SOURCE]
    assert unknown == []


def compose_config(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["docker-compose", "-f", str(OPS / "compose.yaml"), "config"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_compose_is_a_whole_deployment_from_one_image() -> None:
    checked = compose_config(FLOWER_BASIC_AUTH="ops:secret")
    assert checked.returncode == 0, checked.stderr
    services = yaml.safe_load(checked.stdout)["services"]
    assert set(services) >= {"postgres", "redis", "minio", "worker-cpu", "worker-gpu", "beat",
                             "flower", "metrics", "migrate"}  # fmt: skip
    ours = {
        name: service for name, service in services.items() if service.get("image") == "sdq:latest"
    }
    assert {service["build"]["dockerfile"] for service in ours.values()} == {"ops/Dockerfile"}
    for service in ours.values():
        entrypoint = service.get("entrypoint", ["sdq"])
        assert entrypoint[0] == "sdq"
        assert_sdq_command([*entrypoint[1:], *service.get("command", [])])
        assert_known_settings(list(service["environment"]))
    assert ours["flower"]["environment"]["FLOWER_BASIC_AUTH"] == "ops:secret"
    [gpus] = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpus["driver"] == "nvidia" and "gpu" in gpus["capabilities"]
    # Everything of sdq's waits for the schema; the schema waits for Postgres.
    assert all("migrate" in service["depends_on"] for name, service in ours.items()
               if name != "migrate")  # fmt: skip
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_compose_refuses_to_start_flower_without_credentials() -> None:
    env = {key: value for key, value in os.environ.items() if key != "FLOWER_BASIC_AUTH"}
    checked = subprocess.run(
        ["docker-compose", "-f", str(OPS / "compose.yaml"), "config"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert checked.returncode != 0 and "FLOWER_BASIC_AUTH" in checked.stderr


def test_the_image_holds_every_package_folder() -> None:
    lines = (OPS / "Dockerfile").read_text().splitlines()
    copied = {line.split()[1] for line in lines if line.startswith("COPY ")}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(project["tool"]["setuptools"]["package-dir"].values())
    assert folders <= copied and {"pyproject.toml"} <= copied
    assert all((ROOT / path).exists() for path in copied)
    allowed = (OPS / "Dockerfile.dockerignore").read_text().split()
    assert all(f"!{path}" in allowed for path in copied)
    assert 'ENTRYPOINT ["sdq"]' in lines


def test_the_image_pins_the_torch_this_suite_runs_and_ci_installs() -> None:
    """ops/Dockerfile installs the torch release sdq is tested with, from PyPI by default
    (that release's own CUDA build), not whatever sdq's dependencies would pull."""
    dockerfile = (OPS / "Dockerfile").read_text()
    pinned = re.search(r"^ARG TORCH_VERSION=(\S+)$", dockerfile, re.MULTILINE).group(1)
    assert pinned == version("torch").split("+")[0]  # the suite's own, not imported here
    assert f"torch=={pinned}" in (ROOT / ".ci" / "run").read_text()
    assert "ARG TORCH_INDEX_URL=https://pypi.org/simple" in dockerfile
    assert 'pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"' in dockerfile


def manifests() -> list[tuple[Path, dict[str, Any]]]:
    return [
        (path, document)
        for path in sorted((OPS / "k8s").glob("*.yaml"))
        for document in yaml.safe_load_all(path.read_text())
        if document
    ]


@pytest.mark.parametrize(
    "path, document", manifests(), ids=lambda value: getattr(value, "name", "")
)
def test_kubernetes_manifests_pass_their_schemas(path: Path, document: dict[str, Any]) -> None:
    if document["kind"] == "ScaledObject":
        jsonschema.validate(document, SCALED_OBJECT)
    else:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_the_train_pods_rdma_block_uncommented_is_a_valid_statefulset() -> None:
    """ops/k8s/train.yaml's commented RDMA block (the device plugin's resource, IPC_LOCK),
    uncommented into the train container, still passes the schema and keeps its GPUs."""
    text = (OPS / "k8s" / "train.yaml").read_text()
    commented = re.search(r"^( *)# securityContext:\n(?:\1# .*\n)+", text, re.MULTILINE)
    indent = commented.group(1)
    block = yaml.safe_load(
        "\n".join(line.removeprefix(f"{indent}# ") for line in commented.group(0).splitlines())
    )
    assert block["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    limits = block["resources"]["limits"]
    assert any(resource.startswith("rdma/") for resource in limits)
    [train] = [document for path, document in manifests() if path.name == "train.yaml"
               and document["kind"] == "StatefulSet"]  # fmt: skip
    [container] = train["spec"]["template"]["spec"]["containers"]
    assert limits["nvidia.com/gpu"] == container["resources"]["limits"]["nvidia.com/gpu"]
    container["securityContext"] = block["securityContext"]
    container["resources"]["limits"].update(limits)
    kubernetes_validate.validate(train, KUBERNETES_VERSION, strict=True)


def test_the_kubernetes_deployment_hangs_together() -> None:
    documents = [document for _, document in manifests()]
    by_kind: dict[str, dict[str, dict[str, Any]]] = {}
    for document in documents:
        by_kind.setdefault(document["kind"], {})[document["metadata"]["name"]] = document
    deployments = by_kind["Deployment"]
    assert set(deployments) == {"sdq-worker-gpu", "sdq-worker-cpu", "sdq-beat", "sdq-flower",
                                "sdq-metrics", "sdq-serve"}  # fmt: skip
    assert deployments["sdq-beat"]["spec"]["replicas"] == 1
    gpu = deployments["sdq-worker-gpu"]["spec"]["template"]["spec"]["containers"][0]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    # Training has machines of its own: each pod's train worker owns all of its GPUs.
    train = by_kind["StatefulSet"]["sdq-train"]
    [trainer] = train["spec"]["template"]["spec"]["containers"]
    ranks = int(trainer["args"][trainer["args"].index("--train-ranks") + 1])
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == ranks
    assert train["spec"]["serviceName"] in by_kind["Service"]
    assert "SDQ_TRAIN_NODE_ADDRESS" in {env["name"] for env in trainer["env"]}
    # Checkpoints are restored to a volume on the machine's disk, not the container's.
    tmpdir = next(env["value"] for env in trainer["env"] if env["name"] == "TMPDIR")
    mounted = {mount["mountPath"]: mount["name"] for mount in trainer["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in train["spec"]["template"]["spec"]["volumes"]}
    assert "ephemeral" in volumes[mounted[tmpdir]]
    assert_known_settings([env["name"] for env in trainer["env"]])
    settings = by_kind["ConfigMap"]["sdq-settings"]["data"]
    assert_known_settings(list(settings) + list(by_kind["Secret"]["sdq-secrets"]["stringData"]))
    workloads = [*deployments.values(), train, *by_kind["Job"].values()]
    for workload in workloads:
        for container in workload["spec"]["template"]["spec"]["containers"]:
            assert_sdq_command(container["args"])
            sources = {next(iter(ref.values()))["name"] for ref in container["envFrom"]}
            assert sources == {"sdq-settings", "sdq-secrets"}
    # Each pool scales on exactly the queues it consumes; the GPU pool leaves the kinds that
    # run on ranks (training) to machines of their own.
    pooled = [
        queue
        for kind in KINDS.values()
        if kind.pool is Pool.gpu and not kind.on_ranks
        for queue in (kind.queue, kind.lane)
        if queue
    ]
    assert gpu["args"][gpu["args"].index("--queues") + 1] == ",".join(pooled)
    scaled = {
        document["spec"]["scaleTargetRef"]["name"]: {
            trigger["metadata"].get("listName") or trigger["metadata"]["query"]
            for trigger in document["spec"]["triggers"]
        }
        for document in by_kind["ScaledObject"].values()
    }
    assert scaled == {
        "sdq-worker-gpu": set(pooled),
        "sdq-worker-cpu": set(POOL_QUEUES[Pool.cpu]) - {MAINTENANCE_QUEUE},
        "sdq-serve": {"max(sdq_serve_requests_in_flight)"},  # tests/test_serve.py scrapes it
    }
    # The CPU pool also serves beat's maintenance queue: never scaled to nothing.
    cpu = next(d for d in by_kind["ScaledObject"].values()
               if d["spec"]["scaleTargetRef"]["name"] == "sdq-worker-cpu")  # fmt: skip
    assert cpu["spec"]["minReplicaCount"] >= 1


def test_systemd_units_run_sdq_commands_beat_included() -> None:
    units = sorted((OPS / "systemd").glob("*.service"))
    assert {unit.stem for unit in units} >= {"sdq-worker-gpu", "sdq-worker-cpu", "sdq-beat"}
    for unit in units:
        [start] = [line for line in unit.read_text().splitlines() if line.startswith("ExecStart=")]
        program, *args = shlex.split(start.removeprefix("ExecStart="))
        assert program.endswith("/sdq")
        assert_sdq_command(args)


def test_the_environment_example_lists_every_setting_with_its_default() -> None:
    """Each setting is declared once (models/settings.py, and each kind's group beside the
    kind); the example lists them all, a number with the default the declaration gives it."""
    from sdq.models import settings

    example = (OPS / "sdq.env.example").read_text()
    groups = (settings.JobSettings, settings.MaintenanceSettings, *settings.kind_groups())
    assert len(groups) == 5  # generate's, download's and train's
    declared = [field for group in groups for field in fields(group)]
    names = [field.metadata["env"] for field in declared]
    assert len(names) == len(set(names)) > 30
    for field in declared:
        listed = re.search(rf"^(?:# )?{field.metadata['env']}=(\S*)", example, re.MULTILINE)
        assert listed, f"{field.metadata['env']} is not in ops/sdq.env.example"
        if isinstance(field.default, int | float):
            assert float(listed.group(1)) == field.default, field.metadata["env"]
