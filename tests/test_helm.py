"""The Helm chart (helm/fraud-scoring) and the images, checked without a cluster.

Rendering and linting use Helm's own Go SDK through the ``helm-python-sdk`` wheel (no
``helm`` binary); every rendered object is validated with ``kubernetes-validate`` in
strict mode against a pinned Kubernetes version. The chart is then held against the
package: each rendered container command is run with ``--help``, and the scoring
command is started with its rendered environment against a real Redis-protocol
server and asked its rendered probe paths.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from helm_python import _native

from fraud_scoring.redis_server import free_port
from tests.conftest import wait_until as shared_wait_until

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "fraud-scoring"
KUBE_VERSION = "1.30.0"
# The chart's kubeVersion floor: preStop falls back from the sleep action to exec.
MIN_KUBE_VERSION = "1.27.0"
RELEASE = "fraud"
NAMESPACE = "risk"
PROMETHEUS_OPERATOR_API = "monitoring.coreos.com/v1"

CI_FILES = sorted((CHART / "ci").glob("*-values.yaml"))
CASES: dict[str, dict[str, Any] | None] = {"default": None} | {
    p.name.removesuffix("-values.yaml"): yaml.safe_load(p.read_text()) for p in CI_FILES
}
POD_KINDS = {"Deployment", "StatefulSet", "Job", "CronJob", "Pod"}


def missing_tool(reason: str) -> None:
    """Skip when an outside tool a test drives (promtool) is not installed, but fail under
    ``CI=true``, where scripts/test.sh installs it. Product code is never skipped."""
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


# --- rendering ---------------------------------------------------------------------


@functools.cache
def _chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def render_raw(
    values: dict[str, Any] | None = None,
    *,
    api_versions: tuple[str, ...] = (),
    kube_version: str = KUBE_VERSION,
    is_install: bool = True,
) -> dict[str, str]:
    """Template path -> rendered text, like ``helm template``.

    ``Chart.render`` does not expose the SDK's ``kube_version`` and ``api_versions``
    render options (``helm template --kube-version/--api-versions``), which the
    ServiceMonitor and preStop branches need, so the native call is made directly
    with the option names the library decodes.
    """
    opts = {
        "name": RELEASE,
        "namespace": NAMESPACE,
        "is_install": is_install,
        "is_upgrade": not is_install,
        "kube_version": f"v{kube_version}",
        "api_versions": list(api_versions),
    }
    payload = _native.call_string(
        "helm_render",
        _chart()._raw(),
        None if values is None else json.dumps(values),
        json.dumps(opts),
    )
    rendered: dict[str, str] = json.loads(payload)
    return rendered


def render(values: dict[str, Any] | None = None, **kwargs: Any) -> list[dict[str, Any]]:
    """Rendered Kubernetes objects (NOTES.txt left out)."""
    docs: list[dict[str, Any]] = []
    for path, text in sorted(render_raw(values, **kwargs).items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


@functools.cache
def rendered_case(case: str, with_operator: bool = True) -> list[dict[str, Any]]:
    apis = (PROMETHEUS_OPERATOR_API,) if with_operator else ()
    return render(CASES[case], api_versions=apis)


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    if doc["kind"] == "Pod":
        return doc["spec"]
    if doc["kind"] == "CronJob":
        return doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return doc["spec"]["template"]["spec"]


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def component(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The workload of one app.kubernetes.io/component."""
    matches = [
        d
        for d in docs
        if d["kind"] in POD_KINDS
        and d["metadata"]["labels"].get("app.kubernetes.io/component") == name
    ]
    assert len(matches) == 1, f"component {name}: {len(matches)} workloads"
    return matches[0]


def app_images(values: dict[str, Any] | None) -> set[str]:
    merged = _chart().merge_values(values or {})
    return {
        merged["image"]["repository"],
        merged["jobsImage"]["repository"],
        merged["gpu"]["image"]["repository"],
    }


def app_containers(docs: list[dict[str, Any]], values: dict[str, Any] | None) -> Iterator[Any]:
    """(workload, container) for every fraud-scoring container (not the helm test pod)."""
    repos = app_images(values)
    for doc in docs:
        if doc["kind"] not in POD_KINDS - {"Pod"}:
            continue
        for c in containers(pod_spec(doc)):
            if re.split(r"[:@]", c["image"])[0] in repos:
                yield doc, c


# --- lint, schema, Kubernetes validation ---------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_lint_strict(case: str) -> None:
    report = helm.lint(
        CHART, CASES[case], strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}"
    )
    assert report["errors"] == []
    # Severity 1 (info: "icon is recommended") is allowed; warnings and errors are not.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kube_version", [MIN_KUBE_VERSION, KUBE_VERSION])
def test_every_object_is_valid_kubernetes(case: str, kube_version: str) -> None:
    docs = render(CASES[case], api_versions=(PROMETHEUS_OPERATOR_API,), kube_version=kube_version)
    assert docs
    for doc in docs:
        if doc["kind"] in {"ServiceMonitor", "PodMonitor", "PrometheusRule"}:
            continue  # CRDs: kubernetes-validate has no schema; checked on their own below
        kubernetes_validate.validate(doc, kube_version, strict=True)


@pytest.mark.parametrize("case", CASES)
def test_standard_labels_and_restricted_security(case: str) -> None:
    docs = rendered_case(case)
    for doc in docs:
        labels = doc["metadata"]["labels"]
        for key in ("name", "instance", "version", "managed-by", "part-of"):
            assert f"app.kubernetes.io/{key}" in labels, (doc["kind"], key)
        assert labels["app.kubernetes.io/instance"] == RELEASE
        if doc["kind"] not in POD_KINDS:
            continue
        spec = pod_spec(doc)
        what = f"{doc['kind']}/{doc['metadata']['name']}"
        assert spec["securityContext"]["runAsNonRoot"] is True, what
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, what
        assert spec["automountServiceAccountToken"] is False, what
        mounts_tmp = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
        for c in containers(spec):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (what, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"], (what, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (what, c["name"])
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, (what, c["name"])
            assert "resources" in c and c["resources"].get("requests"), (what, c["name"])
            if doc["kind"] != "Pod":  # the test pod writes nothing
                tmp = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
                assert tmp and tmp[0]["name"] in mounts_tmp, (what, c["name"])


BAD_VALUES: dict[str, dict[str, Any]] = {
    "unknown top-level key": {"replicas": 3},
    "unknown nested key": {"scoring": {"autoscaling": {"targetCPU": 50}}},
    "typo in redis block": {"redis": {"inChart": {"enable": True}}},
    "string for integer": {"scoring": {"replicaCount": "two"}},
    "string for boolean": {"gpu": {"enabled": "yes"}},
    "number for string": {"redis": {"host": 6379}},
    "port out of range": {"redis": {"port": 70000}},
    "unknown stream source": {"streaming": {"source": "pulsar"}},
    "unknown execution provider": {"scoring": {"config": {"executionProvider": "tpu"}}},
    "unknown storage type": {"storage": {"type": "s3"}},
    "negative drain": {"scoring": {"drainSeconds": -1}},
    "bad pull policy": {"image": {"pullPolicy": "Sometimes"}},
    "password unsafe in a URL": {"redis": {"password": "p@ss/word"}},
    "list for map": {"scoring": {"nodeSelector": ["gpu"]}},
    "unknown auth mode": {"scoring": {"auth": {"mode": "optional"}}},
    "plaintext key in values": {
        "scoring": {"auth": {"keys": [{"id": "a", "sha256": "a.s3cret", "scopes": ["score"]}]}}
    },
    "unknown scope": {
        "scoring": {"auth": {"keys": [{"id": "a", "sha256": "0" * 64, "scopes": ["root"]}]}}
    },
    "unknown degraded policy": {"scoring": {"degradedPolicy": "guess"}},
    "schedule in words": {"batch": {"schedule": "every day"}},
    "schedule with six fields": {"training": {"schedule": "0 0 3 * * 0"}},
    "schedule minute out of range": {"batch": {"schedule": "61 1 * * *"}},
    "schedule with a TZ prefix": {"batch": {"schedule": "TZ=Europe/Paris 30 1 * * *"}},
    "unknown schedule macro": {"training": {"schedule": "@fortnightly"}},
    "unknown score-stream key": {"scoreStream": {"maxBatchSize": 64}},
    "string for the in-flight bound": {"scoreStream": {"maxInFlight": "lots"}},
    "zero latency budget": {"scoreStream": {"latencyBudgetMs": 0}},
    "fractional lag target": {"scoreStream": {"autoscaling": {"targetLagPerPod": 0.5}}},
}

GOOD_SCHEDULES = ["*/15 * * * *", "0 0 1,15 * MON-FRI", "5 4 * JAN,JUL SUN", "@daily", "@every 6h"]


@pytest.mark.parametrize("schedule", GOOD_SCHEDULES)
def test_schema_takes_kubernetes_cron_schedules(schedule: str) -> None:
    _chart().validate_schema({"batch": {"schedule": schedule}, "training": {"schedule": schedule}})


@pytest.mark.parametrize("bad", BAD_VALUES.values(), ids=list(BAD_VALUES))
def test_schema_refuses_bad_values(bad: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        _chart().validate_schema(bad)
    with pytest.raises(helm.HelmValuesError):
        render(bad)


TEMPLATE_FAILURES: dict[str, tuple[dict[str, Any], str]] = {
    "kafka without brokers": (
        {"streaming": {"source": "kafka"}},
        "streaming.kafka.bootstrapServers is required",
    ),
    "grace period shorter than drain": (
        {"scoring": {"terminationGracePeriodSeconds": 12, "drainSeconds": 10}},
        "must exceed preStopSleepSeconds + drainSeconds",
    ),
    "volume storage without a volume": (
        {"storage": {"type": "volume"}},
        "storage.volume must be set",
    ),
    "external redis without host": ({"redis": {"host": ""}}, "redis.host is required"),
    "cluster in the chart": (
        {"redis": {"cluster": True, "inChart": {"enabled": True}}},
        "redis.cluster needs an external cluster",
    ),
    "cluster with a database": (
        {"redis": {"cluster": True, "db": 2}},
        "redis.cluster needs redis.db: 0",
    ),
    # The gRPC server runs only with a port: a TLS Secret without one was ignored.
    "gRPC TLS without a gRPC port": (
        {"scoring": {"service": {"grpcTlsSecret": "scoring-grpc-tls"}}},
        "scoring.service.grpcTlsSecret needs scoring.service.grpcPort",
    ),
    # score-stream reads the event log named by streaming.*, with or without the updater.
    "score-stream on kafka without brokers": (
        {"streaming": {"enabled": False, "source": "kafka"}, "scoreStream": {"enabled": True}},
        "streaming.kafka.bootstrapServers is required",
    ),
    # As `fraud-scoring score-stream` refuses: the budget holds the wait and the model.
    "score-stream output brokers without Kafka": (
        {"scoreStream": {"enabled": True, "outputBootstrapServers": "k:9092"}},
        "scoreStream.outputBootstrapServers is for a Kafka event log",
    ),
    # As every process refuses to start: a PII field is hashed with a key from a Secret.
    "a pii field without its key": (
        {"features": "fields:\n  - name: email\n    type: string\n    pii: true\n"},
        "features declares a pii: true field: set piiKey.existingSecret",
    ),
    "score-stream wait at its budget": (
        {"scoreStream": {"enabled": True, "maxWaitMs": 250, "latencyBudgetMs": 250}},
        "scoreStream.maxWaitMs (250) must be below scoreStream.latencyBudgetMs (250)",
    ),
}


@pytest.mark.parametrize(
    ("values", "message"), TEMPLATE_FAILURES.values(), ids=list(TEMPLATE_FAILURES)
)
def test_inconsistent_values_fail_to_render(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        render(values)


# --- what the chart promises ----------------------------------------------------------


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def test_scoring_deployment_probes_autoscaling_and_graceful_shutdown() -> None:
    docs = rendered_case("default")
    deploy = component(docs, "scoring")
    assert deploy["kind"] == "Deployment"
    assert "replicas" not in deploy["spec"], "the HPA owns the replica count"
    spec = pod_spec(deploy)
    (c,) = spec["containers"]
    env = env_of(c)
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
    assert env["FRAUD_PORT"]["value"] == str(port)
    assert env["FRAUD_HOST"]["value"] == "0.0.0.0"
    assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]

    drain = float(env["FRAUD_DRAIN_SECONDS"]["value"])
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert spec["terminationGracePeriodSeconds"] > pre_stop + drain

    service = one(docs, "Service", deploy["metadata"]["name"])
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"

    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deploy["metadata"]["name"],
    }
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()

    # Below Kubernetes 1.30 the sleep action is not on by default: exec sleep instead.
    old = component(render(None, kube_version=MIN_KUBE_VERSION), "scoring")
    (old_c,) = pod_spec(old)["containers"]
    assert old_c["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", str(pre_stop)]}}


def test_minimal_install_has_fixed_replicas_and_no_optional_parts() -> None:
    docs = rendered_case("minimal")
    kinds = {d["kind"] for d in docs}
    assert {"HorizontalPodAutoscaler", "PodDisruptionBudget", "CronJob"}.isdisjoint(kinds)
    assert component(docs, "scoring")["spec"]["replicas"] == 1
    assert not any(
        d["metadata"]["labels"].get("app.kubernetes.io/component") == "streaming" for d in docs
    )


def test_cronjobs_never_overlap_and_have_deadlines() -> None:
    docs = rendered_case("default")
    jobs = {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in find(docs, "CronJob")
    }
    assert set(jobs) == {"batch", "training"}
    for name, cj in jobs.items():
        spec = cj["spec"]
        assert spec["concurrencyPolicy"] == "Forbid", name
        assert spec["startingDeadlineSeconds"] > 0, name
        assert spec["timeZone"] == "Etc/UTC", name
        job = spec["jobTemplate"]["spec"]
        assert job["backoffLimit"] >= 0 and job["activeDeadlineSeconds"] > 0, name
        assert job["template"]["spec"]["restartPolicy"] == "Never", name
        assert len(cj["metadata"]["name"]) <= 52, "CronJob names longer than 52 fail"
    assert pod_spec(jobs["batch"])["containers"][0]["args"] == ["batch"]
    assert pod_spec(jobs["training"])["containers"][0]["args"] == ["train"]


def test_streaming_replicas_share_one_consumer_group() -> None:
    docs = rendered_case("external-redis-existing-secret")
    deploy = component(docs, "streaming")
    assert deploy["spec"]["replicas"] == 3
    (c,) = pod_spec(deploy)["containers"]
    assert c["args"][:3] == ["stream", "--source", "kafka"]
    metrics_port = c["args"][c["args"].index("--metrics-port") + 1]
    assert {"name": "metrics", "containerPort": int(metrics_port), "protocol": "TCP"} in c["ports"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    env = env_of(c)
    assert env["FRAUD_CONSUMER_GROUP"]["value"] == "session-updater"
    assert env["FRAUD_KAFKA_BOOTSTRAP"]["value"] == "kafka-0.kafka:9092,kafka-1.kafka:9092"
    assert env["FRAUD_STREAM_NAME"]["value"] == "card-transactions"


def flag_values(args: list[str]) -> dict[str, str]:
    """``["cmd", "--a", "1", "--b", "2"]`` -> ``{"--a": "1", "--b": "2"}``."""
    return dict(zip(args[1::2], args[2::2], strict=True))


@pytest.mark.parametrize("case", sorted(CASES))
def test_score_stream_is_off_unless_enabled(case: str) -> None:
    docs = rendered_case(case)
    ours = [d for d in docs if d["metadata"]["name"].endswith("-score-stream")]
    if (CASES[case] or {}).get("scoreStream", {}).get("enabled"):
        assert {d["kind"] for d in ours} == {
            "Deployment",
            "HorizontalPodAutoscaler",
            "NetworkPolicy",
            "PodMonitor",
        }
    else:
        assert ours == []
        assert not any(
            d["metadata"]["labels"].get("app.kubernetes.io/component") == "score-stream"
            for d in docs
        )


def test_score_stream_values_become_its_flags_probes_and_lag_autoscaling() -> None:
    docs = rendered_case("score-stream")
    values = CASES["score-stream"]
    assert values is not None
    s = values["scoreStream"]
    deploy = component(docs, "score-stream")
    assert deploy["kind"] == "Deployment"
    assert "replicas" not in deploy["spec"], "the HPA owns the replica count"
    spec = pod_spec(deploy)
    (c,) = spec["containers"]
    assert c["args"][0] == "score-stream"
    assert flag_values(c["args"]) == {
        "--source": "kafka",
        "--stream": "card-transactions",
        "--group": "fraud-score-stream",
        "--output": "card-transaction-decisions",
        "--output-bootstrap": "decisions-kafka-0.decisions-kafka:9092",
        "--max-batch": "128",
        "--max-wait-ms": "2.5",
        "--latency-budget-ms": "100",
        "--commit-interval-ms": "500",
        "--max-in-flight": "8192",
        "--metrics-port": "9109",
    }
    env = env_of(c)
    assert env["FRAUD_KAFKA_BOOTSTRAP"]["value"] == "kafka-0.kafka:9092,kafka-1.kafka:9092"
    assert env["FRAUD_MODEL_INSTANCES"]["value"] == "2"
    assert env["FRAUD_STREAM_NAME"]["value"] == "card-transactions"
    assert c["resources"] == s["resources"]
    # The updater's probes on the metrics port, and a startup probe for the model load.
    assert {"name": "metrics", "containerPort": 9109, "protocol": "TCP"} in c["ports"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    assert c["startupProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    # Its grace period covers the drain of what is in flight (FRAUD_DRAIN_SECONDS, 10 s).
    assert spec["terminationGracePeriodSeconds"] > 10

    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    hpa = one(docs, "HorizontalPodAutoscaler", deploy["metadata"]["name"])
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deploy["metadata"]["name"],
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 12)
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "fraud_score_stream_consumer_lag"},
                "target": {"type": "AverageValue", "averageValue": "2000"},
            },
        }
    ]
    pm = one(docs, "PodMonitor", deploy["metadata"]["name"])
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint == endpoint | {"port": "metrics", "path": "/metrics"}
    policy = one(docs, "NetworkPolicy", deploy["metadata"]["name"])
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["ingress"] == [{"ports": [{"port": "metrics", "protocol": "TCP"}]}]
    assert "Egress" in policy["spec"]["policyTypes"]
    assert {"port": 9092, "protocol": "TCP"} in [
        p for rule in policy["spec"]["egress"] for p in rule.get("ports", [])
    ]

    # Default values, turned on: the updater's stream, fixed replicas, its own group.
    plain = render({"scoreStream": {"enabled": True}})
    deploy = component(plain, "score-stream")
    assert deploy["spec"]["replicas"] == 1
    assert not find(plain, "HorizontalPodAutoscaler", deploy["metadata"]["name"])
    flags = flag_values(pod_spec(deploy)["containers"][0]["args"])
    assert (flags["--source"], flags["--stream"]) == ("redis", "transactions")
    updater = pod_spec(component(plain, "streaming"))["containers"][0]
    assert flags["--group"] != env_of(updater)["FRAUD_CONSUMER_GROUP"]["value"]


def _strip_mirror_note(text: str, first_line: str) -> str:
    """The chart's copy opens with a comment saying what it mirrors; drop it."""
    lines = text.strip().splitlines()
    start = lines.index(first_line)
    assert all(line.startswith("#") for line in lines[:start])
    return "\n".join(lines[start:])


def test_feature_store_configmap_mirrors_feature_repo_and_is_mounted() -> None:
    docs = rendered_case("default")
    cm = one(docs, "ConfigMap", f"{RELEASE}-fraud-scoring-config")
    shipped = (ROOT / "feature_repo" / "feature_store.yaml").read_text()
    mirrored = _strip_mirror_note(cm["data"]["feature_store.yaml"], shipped.splitlines()[0])
    assert mirrored == shipped.strip()
    assert yaml.safe_load(cm["data"]["feature_store.yaml"]) == yaml.safe_load(shipped)

    for workload, c in app_containers(docs, None):
        spec = pod_spec(workload)
        path = env_of(c)["FRAUD_FEATURE_STORE_YAML"]["value"]
        mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        assert volume["configMap"]["name"] == cm["metadata"]["name"]
        storage = env_of(c)["FRAUD_DATA_DIR"]["value"]
        assert any(storage.startswith(m["mountPath"] + "/") for m in c["volumeMounts"])


def test_declared_features_from_values_reach_every_pod(tmp_path: Path) -> None:
    """values `features` (a features.yaml of one's own) is in the ConfigMap and every
    app container reads it through FRAUD_FEATURES_FILE; without it none is set."""
    from fraud_scoring import declared as D
    from fraud_scoring import features as F

    assert all(
        "FRAUD_FEATURES_FILE" not in env_of(c)
        for _, c in app_containers(rendered_case("default"), None)
    )
    doc = yaml.safe_load(D.DEFAULT_PATH.read_text())
    doc["reasons"].append(
        {"code": "BUSY_DEVICE", "when": "device_txn_count_1h >= 5", "message": "busy"}
    )
    docs = render({"features": yaml.safe_dump(doc)})
    cm = one(docs, "ConfigMap", f"{RELEASE}-fraud-scoring-config")
    mounted = tmp_path / "features.yaml"
    mounted.write_text(cm["data"]["features.yaml"])
    assert "BUSY_DEVICE" in [r.code for r in F.load_declarations(mounted).reasons]
    seen = 0
    for workload, c in app_containers(docs, None):
        path = env_of(c)["FRAUD_FEATURES_FILE"]["value"]
        mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
        volume = next(v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"])
        assert volume["configMap"]["name"] == cm["metadata"]["name"]
        assert path == f"{mount['mountPath']}/features.yaml"
        seen += 1
    assert seen >= 4  # scoring, updater, batch, training, bootstrap


def password_volume(workload: dict[str, Any], c: dict[str, Any]) -> dict[str, Any]:
    """The Secret volume FRAUD_REDIS_PASSWORD_FILE points into; the password is in no
    environment variable of the container."""
    env = env_of(c)
    assert not any("secretKeyRef" in e.get("valueFrom", {}) for e in c["env"]), c["name"]
    path = env["FRAUD_REDIS_PASSWORD_FILE"]["value"]
    (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    assert mount["readOnly"]
    (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"]]
    assert path == f"{mount['mountPath']}/{volume['secret']['items'][0]['path']}"
    return dict(volume)


@pytest.mark.parametrize("case", CASES)
def test_no_redis_password_in_app_environments(case: str) -> None:
    for workload, c in app_containers(rendered_case(case), CASES[case]):
        if "FRAUD_REDIS_PASSWORD_FILE" in env_of(c):
            password_volume(workload, c)
        url = urllib.parse.urlsplit(env_of(c)["REDIS_URL"]["value"])
        assert url.password is None, f"{c['name']}: a password in REDIS_URL"


def test_a_cluster_endpoint_reaches_every_app_container() -> None:
    values = {"redis": {"host": "redis-cluster.cache", "cluster": True, "waitReplicas": 1}}
    containers = list(app_containers(render(values), values))
    assert containers
    for _, c in containers:
        env = env_of(c)
        assert env["REDIS_URL"]["value"] == "redis://redis-cluster.cache:6379/0"
        assert env["FRAUD_REDIS_CLUSTER"]["value"] == "true", c["name"]
        if "FRAUD_REDIS_WAIT_REPLICAS" in env:
            assert env["FRAUD_REDIS_WAIT_REPLICAS"]["value"] == "1"
    assert any("FRAUD_REDIS_WAIT_REPLICAS" in env_of(c) for _, c in containers)
    plain = render({})
    assert all("FRAUD_REDIS_CLUSTER" not in env_of(c) for _, c in app_containers(plain, {}))


def test_redis_password_from_existing_secret() -> None:
    docs = rendered_case("external-redis-existing-secret")
    assert find(docs, "Secret") == [], "an existing Secret is used, none created"
    for workload, c in app_containers(docs, CASES["external-redis-existing-secret"]):
        env = env_of(c)
        assert env["REDIS_URL"]["value"] == (
            "rediss://fraud@fraud-redis.cache.example.internal:6380/2"
        )
        assert password_volume(workload, c)["secret"] == {
            "secretName": "fraud-redis-credentials",
            "items": [{"key": "password", "path": "password"}],
            "defaultMode": 0o440,
        }
        # The private CA: mounted from its Secret and named by FRAUD_REDIS_CA_FILE.
        ca_file = env["FRAUD_REDIS_CA_FILE"]["value"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "redis-ca"]
        assert ca_file == mount["mountPath"] + "/ca.crt" and mount["readOnly"]
    for pod in find(docs, "Deployment") + find(docs, "CronJob"):
        spec = pod["spec"]["jobTemplate"]["spec"] if pod["kind"] == "CronJob" else pod["spec"]
        volumes = spec["template"]["spec"]["volumes"]
        assert {"name": "redis-ca", "secret": {"secretName": "fraud-redis-ca"}} in volumes


def test_pii_key_from_an_existing_secret_in_every_pod() -> None:
    features = "fields:\n  - name: email\n    type: string\n    pii: true\n"
    values = {
        "features": features,
        "piiKey": {"existingSecret": "fraud-pii", "existingSecretKey": "k"},
        "scoreStream": {"enabled": True},
    }
    docs = render(values)
    assert not [d for d in find(docs, "Secret") if "pii" in d["metadata"]["name"]]
    seen = set()
    for workload, c in app_containers(docs, values):
        env = env_of(c)
        assert "FRAUD_PII_KEY" not in env, "never the key itself in the environment"
        path = env["FRAUD_PII_KEY_FILE"]["value"]
        (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        assert mount["readOnly"]
        (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"] == {
            "secretName": "fraud-pii",
            "items": [{"key": "k", "path": "pii-key"}],
            "defaultMode": 0o440,
        }
        assert path == f"{mount['mountPath']}/pii-key"
        seen.add(workload["kind"])
    assert {"Deployment", "CronJob"} <= seen
    plain = render({})
    assert all("FRAUD_PII_KEY_FILE" not in env_of(c) for _, c in app_containers(plain, {}))


def test_in_chart_redis_uses_the_official_valkey_image_and_a_generated_secret() -> None:
    docs = rendered_case("in-chart-redis")
    sts = one(docs, "StatefulSet")
    (redis,) = pod_spec(sts)["containers"]
    assert redis["image"].startswith("docker.io/valkey/valkey:")
    secret = one(docs, "Secret", f"{RELEASE}-fraud-scoring-redis-auth")
    assert len(secret["data"]["redis-password"]) > 20
    service = one(docs, "Service", sts["metadata"]["name"])
    for workload, c in app_containers(docs, CASES["in-chart-redis"]):
        env = env_of(c)
        volume = password_volume(workload, c)
        assert volume["secret"]["secretName"] == secret["metadata"]["name"]
        assert env["REDIS_URL"]["value"] == f"redis://{service['metadata']['name']}:6379/0"
    policy = one(docs, "NetworkPolicy", sts["metadata"]["name"])
    peers = policy["spec"]["ingress"][0]["from"]
    assert peers == [
        {
            "podSelector": {
                "matchLabels": {
                    "app.kubernetes.io/name": "fraud-scoring",
                    "app.kubernetes.io/instance": RELEASE,
                }
            }
        }
    ]


def test_bootstrap_job_runs_on_install_only() -> None:
    docs = rendered_case("in-chart-redis")
    job = component(docs, "bootstrap")
    steps = [c["args"] for c in containers(pod_spec(job))]
    assert steps == _chart().merge_values({})["bootstrap"]["steps"]
    upgrade = render(CASES["in-chart-redis"], is_install=False)
    assert not find(upgrade, "Job")


def test_gpu_values_put_only_the_scoring_pods_on_gpus() -> None:
    docs = rendered_case("gpu")
    deploy = component(docs, "scoring")
    spec = pod_spec(deploy)
    (c,) = spec["containers"]
    assert c["image"].endswith(":0.1.0-gpu")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert env_of(c)["FRAUD_EXECUTION_PROVIDER"]["value"] == "cuda"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["runtimeClassName"] == "nvidia"
    for workload, other in app_containers(docs, CASES["gpu"]):
        if workload is not deploy:
            assert "nvidia.com/gpu" not in other["resources"].get("limits", {})
            assert not other["image"].endswith("-gpu")


def test_service_monitor_only_when_the_operator_api_exists() -> None:
    without = rendered_case("default", with_operator=False)
    assert not find(without, "ServiceMonitor") and not find(without, "PodMonitor")
    docs = rendered_case("default")
    sm = one(docs, "ServiceMonitor")
    service = one(docs, "Service")
    assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}

    pm = one(docs, "PodMonitor")
    streaming = component(docs, "streaming")
    pod_labels = streaming["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    (c,) = pod_spec(streaming)["containers"]
    assert endpoint["port"] in {p["name"] for p in c["ports"]}


def test_network_policies() -> None:
    docs = rendered_case("default")
    scoring = one(docs, "NetworkPolicy", f"{RELEASE}-fraud-scoring-scoring")
    assert scoring["spec"]["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}]}]
    jobs = one(docs, "NetworkPolicy", f"{RELEASE}-fraud-scoring-jobs")
    assert jobs["spec"]["ingress"] == []
    streaming = one(docs, "NetworkPolicy", f"{RELEASE}-fraud-scoring-streaming")
    assert streaming["spec"]["ingress"] == [{"ports": [{"port": "metrics", "protocol": "TCP"}]}]

    locked = rendered_case("external-redis-existing-secret")
    scoring = one(locked, "NetworkPolicy", f"{RELEASE}-fraud-scoring-scoring")
    assert "Egress" in scoring["spec"]["policyTypes"]
    assert {"podSelector": {"matchLabels": {f"{RELEASE}-fraud-scoring-client": "true"}}} in (
        scoring["spec"]["ingress"][0]["from"]
    )
    # The helm test pod carries the client label, so it still reaches the API.
    test_pod = one(locked, "Pod")
    assert test_pod["metadata"]["labels"][f"{RELEASE}-fraud-scoring-client"] == "true"


def test_notes_render() -> None:
    notes = render_raw(None)["fraud-scoring/templates/NOTES.txt"]
    assert "helm test fraud -n risk" in notes
    assert "/v1/score" in notes


# --- the images ------------------------------------------------------------------------


def dockerfile_entrypoint(name: str) -> list[str]:
    text = (ROOT / name).read_text()
    (line,) = re.findall(r"^ENTRYPOINT\s+(\[.*\])\s*$", text, flags=re.M)
    entrypoint: list[str] = json.loads(line)
    return entrypoint


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_images_are_multistage_nonroot_and_run_the_console_script(dockerfile: str) -> None:
    text = (ROOT / dockerfile).read_text()
    stages = re.findall(r"^FROM\s+\S+(?:\s+AS\s+(\S+))?", text, flags=re.M | re.I)
    assert len(stages) >= 2, "multi-stage build"
    final = text[text.rfind("\nFROM ") :]
    assert not re.search(r"\b(gcc|g\+\+|build-essential|make|cmake|-dev)\b", final)
    (user,) = re.findall(r"^USER\s+(\S+)", final, flags=re.M)
    assert not user.startswith(("root", "0")), user
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    entrypoint = dockerfile_entrypoint(dockerfile)
    assert entrypoint[-1] in scripts
    assert entrypoint == dockerfile_entrypoint("Dockerfile")
    # The chart's pod security context runs as this uid.
    uid = re.search(r"ARG APP_UID=(\d+)", final)
    assert uid and int(uid.group(1)) == _chart().values["podSecurityContext"]["runAsUser"]


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_images_build_with_the_classic_builder(dockerfile: str) -> None:
    """No BuildKit-only syntax: no frontend fetched from a registry, no RUN --mount."""
    text = (ROOT / dockerfile).read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, flags=re.M | re.I)
    assert not re.search(r"^RUN\s+--", text, flags=re.M), "RUN flags need BuildKit"
    assert "<<" not in text, "heredocs need BuildKit"


def test_serving_pods_use_the_serving_image_and_jobs_the_jobs_image() -> None:
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert {"serve", "jobs"} <= set(stages)
    docs = render({"jobsImage": {"repository": "registry.example/fraud-jobs"}})
    for doc in docs:
        if doc["kind"] not in POD_KINDS - {"Pod"}:
            continue
        component_name = doc["metadata"]["labels"]["app.kubernetes.io/component"]
        for c in containers(pod_spec(doc)):
            if component_name in ("scoring", "streaming"):
                assert c["image"] == "ghcr.io/example/fraud-scoring:0.1.0", c["name"]
            elif component_name in ("batch", "training", "bootstrap"):
                assert c["image"] == "registry.example/fraud-jobs:0.1.0-jobs", c["name"]


def test_dockerignore_keeps_what_the_wheel_needs() -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]["find"]["include"]
    for pkg in packages:
        assert pkg.rstrip("*") not in ignored
    assert {"pyproject.toml", "README.md"}.isdisjoint(ignored)
    assert {".venv", ".git", "tests", "helm"} <= ignored


# --- the chart held against the package --------------------------------------------


def cli_argv(args: list[str]) -> list[str]:
    """Run the console script the image's ENTRYPOINT names from this checkout's source.

    The containers set only ``args``; the image runs ``tini -- fraud-scoring <args>``.
    """
    script = dockerfile_entrypoint("Dockerfile")[-1]
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"][script]
    module, func = target.split(":")
    code = f"import sys; sys.argv[0] = {script!r}; from {module} import {func}; sys.exit({func}())"
    return [sys.executable, "-c", code, *args]


def rendered_commands() -> list[list[str]]:
    seen: dict[str, list[str]] = {}
    for case, values in CASES.items():
        for _, c in app_containers(rendered_case(case), values):
            assert "command" not in c, "the image entrypoint runs fraud-scoring"
            seen[json.dumps(c["args"])] = c["args"]
    return list(seen.values())


def _env_for_cli() -> dict[str, str]:
    # A pod has none of these; PROMETHEUS_MULTIPROC_DIR is set in this process by importing
    # Feast, and would put the rendered service's /metrics in multiprocess mode.
    skip = ("FRAUD_", "REDIS_", "PROMETHEUS_MULTIPROC_", "prometheus_multiproc_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(skip)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)]))
    return env


@pytest.mark.parametrize("args", rendered_commands(), ids=lambda a: " ".join(a))
def test_rendered_command_exists(args: list[str]) -> None:
    proc = subprocess.run(
        [*cli_argv(args), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=_env_for_cli(),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for flag in (a for a in args if a.startswith("--")):
        assert flag in out, f"{flag} is not an option of `fraud-scoring {args[0]}`"


# --- starting the rendered scoring command ---------------------------------------------


def wait_until(check: Any, timeout: float, what: str, proc: subprocess.Popen | None = None) -> Any:
    return shared_wait_until(check, timeout=timeout, what=what, proc=proc)


@contextlib.contextmanager
def local_redis(password: str) -> Iterator[int]:
    """A real Redis-protocol server on a free loopback port, with ``requirepass``."""
    from urllib.parse import urlparse

    from fraud_scoring.redis_server import embedded_redis

    with embedded_redis(password=password) as url:
        port = urlparse(url).port
        assert port is not None
        yield port


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes dependent variable expansion: $(VAR) from earlier variables, $$ escapes."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0).startswith("$$"):
            return m.group(0)[1:]
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$\([A-Za-z_][A-Za-z0-9_]*\)|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, value)


def container_env(
    c: dict[str, Any],
    docs: list[dict[str, Any]],
    pod_name: str,
    spec: dict[str, Any] | None = None,
    files_dir: Path | None = None,
) -> dict[str, str]:
    """The environment the kubelet would give this container, from the rendered objects.

    With ``spec`` (the pod's) and ``files_dir``, a variable naming a file inside a mounted
    rendered Secret (FRAUD_REDIS_PASSWORD_FILE) is pointed at a copy in ``files_dir``.
    """
    import base64

    secrets = {s["metadata"]["name"]: s for s in find(docs, "Secret")}
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(str(e["value"]), env)
        elif ref := e["valueFrom"].get("secretKeyRef"):
            data = secrets[ref["name"]]["data"][ref["key"]]
            env[e["name"]] = base64.b64decode(data).decode()
        elif ref := e["valueFrom"].get("fieldRef"):
            assert ref["fieldPath"] == "metadata.name", ref
            env[e["name"]] = pod_name
        else:
            raise AssertionError(f"unhandled env source {e}")
    if spec is None or files_dir is None:
        return env
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for m in c.get("volumeMounts", []):
        secret = volumes[m["name"]].get("secret")
        if secret is None or secret["secretName"] not in secrets:
            continue
        data = secrets[secret["secretName"]]["data"]
        for item in secret.get("items", [{"key": k, "path": k} for k in data]):
            pod_path = f"{m['mountPath']}/{item['path']}"
            for name, value in env.items():
                if value == pod_path:
                    local = files_dir / f"{m['name']}-{item['path']}"
                    local.write_bytes(base64.b64decode(data[item["key"]]))
                    env[name] = str(local)
    return env


def http_get(url: str, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=5
        ) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def localize(env: dict[str, str], redis_port: int, workdir: Path, fs_yaml: Path) -> dict[str, str]:
    """Pod paths and hosts become local ones; credentials, database and knobs stay."""
    url = urllib.parse.urlsplit(env["REDIS_URL"])
    userinfo = url.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@127.0.0.1:{redis_port}" if userinfo else f"127.0.0.1:{redis_port}"
    return env | {
        "REDIS_URL": url._replace(netloc=netloc).geturl(),
        "FRAUD_DATA_DIR": str(workdir / "data"),
        "FRAUD_MODEL_REPO": str(workdir / "models"),
        "FRAUD_FEATURE_STORE_YAML": str(fs_yaml),
        "HOME": str(workdir),
    }


def write_feature_store_yaml(docs: list[dict[str, Any]], workdir: Path) -> Path:
    """The file the pods read from the rendered ConfigMap."""
    path = workdir / "feature_store.yaml"
    path.write_text(
        one(docs, "ConfigMap", f"{RELEASE}-fraud-scoring-config")["data"]["feature_store.yaml"]
    )
    return path


@contextlib.contextmanager
def running_scoring(
    docs: list[dict[str, Any]], redis_port: int, workdir: Path
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Start the rendered scoring container's command with its rendered environment.

    Yields the base URL once the startup and liveness probe paths answer 200. On exit
    sends SIGTERM (what the kubelet sends after preStop) and requires the process to
    end within the rendered termination grace period.
    """
    spec = pod_spec(component(docs, "scoring"))
    (c,) = spec["containers"]
    env = container_env(c, docs, f"{RELEASE}-fraud-scoring-7d9f-abcde", spec, workdir)
    named_ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert named_ports[c[probe]["httpGet"]["port"]] == int(env["FRAUD_PORT"])
    port = free_port()
    env = localize(env, redis_port, workdir, write_feature_store_yaml(docs, workdir))
    env["FRAUD_PORT"] = str(port)
    log = (workdir / "serve.log").open("w+")
    proc = subprocess.Popen(
        cli_argv(c["args"]),
        env=_env_for_cli() | env,
        cwd=workdir,
        stdout=log,
        stderr=subprocess.STDOUT,
    )

    def output() -> str:
        log.flush()
        return (workdir / "serve.log").read_text()[-3000:]

    base = f"http://127.0.0.1:{port}"
    try:
        for probe in ("startupProbe", "livenessProbe"):
            path = c[probe]["httpGet"]["path"]
            try:
                wait_until(lambda p=path: http_get(base + p) == 200, 60, f"{probe} {path}", proc)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{output()}") from None
        yield base, c
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=spec["terminationGracePeriodSeconds"])
        except subprocess.TimeoutExpired:
            raise AssertionError(f"no exit within the grace period\n{output()}") from None
        assert proc.returncode in (0, -signal.SIGTERM), output()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def new_key(key_id: str, scopes: list[str]) -> tuple[str, dict[str, Any]]:
    """A fresh API key and its hashed ``scoring.auth.keys`` entry."""
    from service.edge.auth import new_key as make

    key, sha256 = make(key_id)
    return key, {"id": key_id, "sha256": sha256, "scopes": scopes}


def test_rendered_scoring_command_starts_and_answers_its_probes(tmp_path: Path) -> None:
    """Default values plus a Redis password; no model yet, so /readyz answers 503."""
    password = "rendered-s3cret"
    key, entry = new_key("scraper", ["metrics"])
    docs = render({"redis": {"password": password}, "scoring": {"auth": {"keys": [entry]}}})
    spec = pod_spec(component(docs, "scoring"))
    (c,) = spec["containers"]
    env = container_env(c, docs, "x", spec, tmp_path)
    assert env["REDIS_URL"] == "redis://redis:6379/0"
    assert Path(env["FRAUD_REDIS_PASSWORD_FILE"]).read_text() == password
    assert env["FRAUD_AUTH"] == "required"
    assert json.loads(Path(env["FRAUD_API_KEYS_FILE"]).read_text())["id"] == "scraper"
    with (
        local_redis(password) as redis_port,
        running_scoring(docs, redis_port, tmp_path) as (
            base,
            c,
        ),
    ):
        assert http_get(base + c["readinessProbe"]["httpGet"]["path"]) in (200, 503)
        assert http_get(base + "/metrics") == 401
        assert http_get(base + "/metrics", key) == 200


# --- the helm test hook ----------------------------------------------------------------


class _StubScoring(http.server.BaseHTTPRequestHandler):
    answer: ClassVar[dict[str, Any]] = {}
    # The one key it accepts (None: any caller), as the service with auth required.
    key: ClassVar[str | None] = None

    def do_GET(self) -> None:
        self._reply(200 if self.path == "/readyz" else 404, {"status": "ok"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/v1/score" and body["amount"] > 0
        if self.key is not None and self.headers.get("Authorization") != f"Bearer {self.key}":
            self._reply(401, {"detail": "invalid API key"})
            return
        self._reply(200, self.answer)

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def stub_scoring(answer: dict[str, Any], key: str | None = None) -> Iterator[str]:
    handler = type("Handler", (_StubScoring,), {"answer": answer, "key": key})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


GOOD_ANSWER = {
    "decision": "review",
    "score": 0.42,
    "reasons": ["amount_high"],
    "model_version": "3",
    "features": {},
    "timing": {"total_ms": 4.2},
}


@pytest.mark.parametrize(
    ("answer", "passes"),
    [
        (GOOD_ANSWER, True),
        (GOOD_ANSWER | {"decision": "maybe"}, False),
        (GOOD_ANSWER | {"score": 7}, False),
        ({k: v for k, v in GOOD_ANSWER.items() if k != "model_version"}, False),
    ],
    ids=["valid", "bad-decision", "bad-score", "no-model-version"],
)
def test_helm_test_hook_checks_the_scoring_answer(
    answer: dict[str, Any], passes: bool, tmp_path: Path
) -> None:
    docs = rendered_case("default")
    pod = one(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["python", "-c"]
    service = one(docs, "Service", f"{RELEASE}-fraud-scoring")
    rendered_env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    assert rendered_env["SCORING_URL"] == (
        f"http://{service['metadata']['name']}.{NAMESPACE}.svc:"
        f"{service['spec']['ports'][0]['port']}"
    )
    # The key as the pod has it: a file from the mounted Secret.
    key_file = tmp_path / Path(rendered_env["SCORING_API_KEY_FILE"]).name
    key_file.write_text("k.1\n")
    with stub_scoring(copy.deepcopy(answer), key="k.1") as url:
        proc = subprocess.run(
            [sys.executable, "-c", *c["args"]],
            env={**rendered_env, "SCORING_URL": url, "SCORING_API_KEY_FILE": str(key_file)}
            | {"PATH": os.environ["PATH"]},
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert (proc.returncode == 0) == passes, proc.stdout + proc.stderr


def test_auth_is_required_by_default_with_hashed_keys_mounted_read_only() -> None:
    """Default values: FRAUD_AUTH=required, the keys file from a Secret the chart makes
    from hashed entries (empty here: every call 401, and NOTES says so), mounted
    read-only as a directory so rotation reaches running pods; the helm test pod and the
    ServiceMonitor take their plaintext keys from Secrets the installer creates."""
    docs = rendered_case("default")
    spec = pod_spec(component(docs, "scoring"))
    (c,) = spec["containers"]
    env = env_of(c)
    assert env["FRAUD_AUTH"]["value"] == "required"
    keys_file = Path(env["FRAUD_API_KEYS_FILE"]["value"])
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == str(keys_file.parent)]
    assert mount["readOnly"] is True and "subPath" not in mount
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])["secret"]
    secret = one(docs, "Secret", volume["secretName"])
    assert secret["data"] == {"api-keys.jsonl": ""}
    for other in ("streaming",):
        assert "FRAUD_API_KEYS_FILE" not in env_of(containers(pod_spec(component(docs, other)))[0])
    test_pod = one(docs, "Pod")["spec"]
    (test_c,) = test_pod["containers"]
    # The test's key as a file from an optional Secret, not in the environment.
    assert "SCORING_API_KEY" not in env_of(test_c)
    key_file = Path(env_of(test_c)["SCORING_API_KEY_FILE"]["value"])
    (mount,) = [m for m in test_c["volumeMounts"] if m["mountPath"] == str(key_file.parent)]
    volume = next(v for v in test_pod["volumes"] if v["name"] == mount["name"])["secret"]
    assert volume == {
        "secretName": f"{RELEASE}-fraud-scoring-test-key",
        "optional": True,
        "items": [{"key": "api-key", "path": key_file.name}],
    }
    (endpoint,) = one(docs, "ServiceMonitor")["spec"]["endpoints"]
    assert (
        endpoint["authorization"]["credentials"]["name"] == f"{RELEASE}-fraud-scoring-metrics-key"
    )
    notes = render_raw(None)["fraud-scoring/templates/NOTES.txt"]
    assert "no keys configured" in notes and "test-key" in notes


def test_auth_keys_from_values_or_an_existing_secret_and_off() -> None:
    key, entry = new_key("checkout", ["score"])
    docs = render({"scoring": {"auth": {"keys": [entry]}}})
    import base64

    (secret,) = [s for s in find(docs, "Secret") if s["metadata"]["name"].endswith("api-keys")]
    text = base64.b64decode(secret["data"]["api-keys.jsonl"]).decode()
    assert [json.loads(line) for line in text.splitlines()] == [entry]
    assert key not in json.dumps(docs)  # hashes only
    weighted = {**entry, "share": 3}  # admission's weight goes through as written
    docs = render({"scoring": {"auth": {"keys": [weighted]}}})
    (secret,) = [s for s in find(docs, "Secret") if s["metadata"]["name"].endswith("api-keys")]
    text = base64.b64decode(secret["data"]["api-keys.jsonl"]).decode()
    assert [json.loads(line) for line in text.splitlines()] == [weighted]
    docs = render({"scoring": {"auth": {"existingSecret": "ops-keys", "existingSecretKey": "k"}}})
    assert not [s for s in find(docs, "Secret") if s["metadata"]["name"].endswith("api-keys")]
    spec = pod_spec(component(docs, "scoring"))
    volume = next(
        v["secret"] for v in spec["volumes"] if v.get("secret", {}).get("secretName") == "ops-keys"
    )
    assert volume["items"] == [{"key": "k", "path": "api-keys.jsonl"}]
    docs = render({"scoring": {"auth": {"mode": "off"}}}, api_versions=(PROMETHEUS_OPERATOR_API,))
    env = env_of(containers(pod_spec(component(docs, "scoring")))[0])
    assert env["FRAUD_AUTH"]["value"] == "off" and "FRAUD_API_KEYS_FILE" not in env
    assert "authorization" not in one(docs, "ServiceMonitor")["spec"]["endpoints"][0]
    test_c = one(docs, "Pod")["spec"]["containers"][0]
    assert "SCORING_API_KEY_FILE" not in env_of(test_c) and "volumeMounts" not in test_c


def test_helm_test_hook_names_the_key_secret_on_401() -> None:
    (c,) = one(rendered_case("default"), "Pod")["spec"]["containers"]
    rendered_env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    with stub_scoring(GOOD_ANSWER, key="k.1") as url:
        proc = subprocess.run(
            [sys.executable, "-c", *c["args"]],
            env=rendered_env | {"SCORING_URL": url, "PATH": os.environ["PATH"]},
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert proc.returncode == 1
    assert "HTTP 401" in proc.stderr and f"{RELEASE}-fraud-scoring-test-key" in proc.stderr


# --- end to end: the in-chart-redis demo release, locally --------------------------------

# Appended to the rendered simulate step so the run fits the test budget. Training refuses
# to publish with fewer than 10 frauds in its validation or holdout days: 1,000 cards
# leave about 7 in the validation days, 2,000 enough.
# And to the train step: a sample of the negatives (as the session's world trains), so the
# fixture's training takes seconds, not a minute.
SMALL_RUN = {
    "simulate": ["--cards", "2000"],
    "train": [
        "--max-train-negatives",
        "15000",
        "--max-holdout-negatives",
        "15000",
        "--calibration-blocks",
        "2",
    ],
}


@pytest.fixture(scope="module")
def demo_release(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, int, Path]]:
    """The in-chart-redis release: its generated Redis password on a local server, and
    the rendered bootstrap Job's steps run in order with their rendered environment."""
    key, entry = new_key("helm-test", ["score"])
    values = copy.deepcopy(CASES["in-chart-redis"]) or {}
    values.setdefault("scoring", {})["auth"] = {"keys": [entry]}
    values["scoreStream"] = {"enabled": True}
    docs = render(values)
    secret = one(docs, "Secret", f"{RELEASE}-fraud-scoring-redis-auth")
    import base64

    password = base64.b64decode(secret["data"]["redis-password"]).decode()
    workdir = tmp_path_factory.mktemp("demo-release")
    fs_yaml = write_feature_store_yaml(docs, workdir)
    job = component(docs, "bootstrap")
    with local_redis(password) as redis_port:
        for c in containers(pod_spec(job)):
            env = localize(
                container_env(c, docs, "bootstrap-x", pod_spec(job), workdir),
                redis_port,
                workdir,
                fs_yaml,
            )
            extra = SMALL_RUN.get(c["args"][0], [])
            proc = subprocess.run(
                cli_argv(c["args"] + extra),
                env=_env_for_cli() | env,
                cwd=workdir,
                capture_output=True,
                text=True,
                timeout=240,  # one step; the training step alone takes ~30 s on a quiet machine
            )
            assert proc.returncode == 0, (c["name"], (proc.stdout + proc.stderr)[-3000:])
        yield docs, redis_port, workdir, key


def test_rendered_bootstrap_job_publishes_a_model(
    demo_release: tuple[Any, int, Path, str],
) -> None:
    _, _, workdir, _ = demo_release
    models = workdir / "models" / _chart().values["model"]["name"]
    assert [p for p in models.iterdir() if p.is_dir()], f"no model version under {models}"


def test_helm_test_hook_passes_against_the_rendered_service(
    demo_release: tuple[Any, int, Path, str],
) -> None:
    docs, redis_port, workdir, key = demo_release
    (test_c,) = one(docs, "Pod")["spec"]["containers"]
    with running_scoring(docs, redis_port, workdir) as (base, c):
        ready = c["readinessProbe"]["httpGet"]["path"]
        wait_until(lambda: http_get(base + ready) == 200, 60, f"{ready} with a model")
        # The Secret the installer creates holds the plaintext key.
        test_env = {e["name"]: e["value"] for e in test_c["env"] if "value" in e}
        proc = subprocess.run(
            [sys.executable, "-c", *test_c["args"]],
            env=test_env
            | {"SCORING_URL": base, "SCORING_API_KEY": key, "PATH": os.environ["PATH"]},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.startswith("OK: decision=")


def test_rendered_streaming_command_runs_and_stops_on_sigterm(
    demo_release: tuple[Any, int, Path, str],
) -> None:
    docs, redis_port, workdir, _ = demo_release
    deploy = component(docs, "streaming")
    spec = pod_spec(deploy)
    (c,) = spec["containers"]
    env = localize(
        container_env(c, docs, f"{RELEASE}-fraud-scoring-streaming-5c8d-x1y2z", spec, workdir),
        redis_port,
        workdir,
        workdir / "feature_store.yaml",
    )
    port = free_port()  # the rendered port may be taken here; the flag's last value wins
    proc = subprocess.Popen(
        cli_argv([*c["args"], "--metrics-port", str(port)]),
        env=_env_for_cli() | env,
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for probe in ("livenessProbe", "readinessProbe"):
            assert c[probe]["httpGet"]["port"] == "metrics"
            path = c[probe]["httpGet"]["path"]
            wait_until(
                lambda p=path: http_get(f"http://127.0.0.1:{port}{p}") == 200, 60, path, proc
            )
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=spec["terminationGracePeriodSeconds"])
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate(timeout=10)[0]
    assert proc.returncode in (0, -signal.SIGTERM), output[-3000:]


def test_challenger_values_reach_the_scoring_pods() -> None:
    """model.challengerVersion / model.canaryPercent become the service's settings."""
    docs = render({"model": {"challengerVersion": "4", "canaryPercent": 5}})
    envs = [
        {e["name"]: e.get("value") for e in c.get("env", [])}
        for d in docs
        if d["kind"] == "Deployment"
        for c in d["spec"]["template"]["spec"]["containers"]
    ]
    assert envs and all(e["FRAUD_CHALLENGER_VERSION"] == "4" for e in envs)
    assert all(e["FRAUD_CANARY_PERCENT"] == "5" for e in envs)
    assert not any("FRAUD_CHALLENGER_VERSION" in e for e in _default_envs())


def _default_envs() -> list[dict[str, Any]]:
    return [
        {e["name"]: e.get("value") for e in c.get("env", [])}
        for d in render()
        if d["kind"] == "Deployment"
        for c in d["spec"]["template"]["spec"]["containers"]
    ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_object_carries_the_release_namespace(case: str) -> None:
    """A rendered manifest applied with `kubectl apply -f` lands in the release's
    namespace, as `helm install -n` puts it (checkov CKV_K8S_21: helm/fraud-scoring/README.md,
    "Security scan")."""
    docs = rendered_case(case)
    assert docs
    assert {d["kind"]: d["metadata"].get("namespace") for d in docs} == {
        d["kind"]: NAMESPACE for d in docs
    }


def test_rendered_score_stream_decides_a_transaction_and_stops_on_sigterm(
    demo_release: tuple[Any, int, Path, str],
) -> None:
    """The rendered score-stream container, with its rendered environment, on the demo
    release's Redis and model: its probes answer, a transaction on the rendered input
    stream gets its decision on the rendered output stream, SIGTERM stops it."""
    import redis

    docs, redis_port, workdir, _ = demo_release
    deploy = component(docs, "score-stream")
    spec = pod_spec(deploy)
    (c,) = spec["containers"]
    env = localize(
        container_env(c, docs, f"{RELEASE}-fraud-scoring-score-stream-7d9f-a1b2c", spec, workdir),
        redis_port,
        workdir,
        workdir / "feature_store.yaml",
    )
    flags = flag_values(c["args"])
    client = redis.Redis.from_url(
        env["REDIS_URL"], password=Path(env["FRAUD_REDIS_PASSWORD_FILE"]).read_text()
    )
    port = free_port()  # the rendered port may be taken here; the flag's last value wins
    proc = subprocess.Popen(
        cli_argv([*c["args"], "--metrics-port", str(port)]),
        env=_env_for_cli() | env,
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["httpGet"]["port"] == "metrics"
            path = c[probe]["httpGet"]["path"]
            wait_until(
                lambda p=path: http_get(f"http://127.0.0.1:{port}{p}") == 200, 90, path, proc
            )
        txn = {
            "transaction_id": "helm-score-stream-1",
            "card_id": "helm-test-card",
            "merchant_id": "helm-test-merchant",
            "amount": 42.5,
            "currency": "USD",
            "event_time": datetime.now(UTC).isoformat(),
            "country": "US",
            "channel": "pos",
            "mcc": "5411",
        }
        client.xadd(flags["--stream"], {"data": json.dumps(txn)})
        wait_until(lambda: client.xlen(flags["--output"]) >= 1, 60, "a decision", proc)
        ((_, fields),) = client.xrange(flags["--output"])
        decision = json.loads(fields[b"d"])
        assert fields[b"k"].decode() == decision["transaction_id"] == txn["transaction_id"]
        assert decision["decision"] in {"approve", "review", "decline"}
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=spec["terminationGracePeriodSeconds"])
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate(timeout=10)[0]
        client.close()
    assert proc.returncode in (0, -signal.SIGTERM), output[-3000:]
