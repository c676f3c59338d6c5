"""deploy/kubernetes as an operator runs it (issue 37, "Operators, third round", items 3 to 13): claims of a
network filesystem class made for each cloud, with the NFS caching the middleware's check of a stored
embedding needs; decode pods that call only the prefill pods, whatever the pod CIDR; the model and the
connectors written once and read by every server, so a change to the base reaches every overlay;
workloads that leave the scale to their HPAs, roll without a surge GPU, and take the placement hooks a
GPU cluster needs; a fleet from nothing in commands the docs give, the Gateway shipped, a smoke request
and a benchmark; the picker's RBAC, rollout and Istio rule as the Inference Extension's chart has them;
the adapter's rules merged, never replacing its configuration; traces wired from one place; images named
by tag in one place only, and the image's user the pods' user; and the README saying what was run.

Rendered with kubectl kustomize (tests/test_deploy.py's helpers: a container's $(VAR) references are
expanded as the kubelet expands them), never applied: no cluster, no GPU."""

from __future__ import annotations

import ast
import ipaddress
import json
import os
import re
import shlex
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

import pytest
import yaml

from epd_middleware import EPDConfig, EPDMiddleware, Host
from epd_middleware._metrics import Stats
from epd_middleware._protocol import EXAMPLE_CONNECTOR_FILE, FRESH_SECONDS, embedding_used
from epd_middleware._scheduler import Scheduler
from epd_middleware.errors import ForbiddenTarget

from .test_deploy import (
    ADAPTER_VALUES,
    COMPONENTS,
    DEPLOY,
    DEPLOYMENT_DOC,
    DOCKERFILE,
    OVERLAYS,
    PROJECT,
    adapter_rules,
    container,
    containers,
    env,
    env_entries,
    flag_json,
    label_selector_matches,
    of_kind,
    pod_labels,
    pod_specs,
    render,
    render_kustomization,
    selects,
    vllm_port,
    vllm_servers,
)

README: Final = PROJECT / "README.md"
BASE_KUSTOMIZATION: Final = DEPLOY / "base" / "kustomization.yaml"
STORAGE_COMPONENTS: Final = [name for name in COMPONENTS if name.startswith("storage-")]
GATEWAY_COMPONENTS: Final = [name for name in COMPONENTS if name.startswith("gateway-")]
# The pods' user: the image's USER (deploy/docker/Dockerfile) and every pod's runAsUser, runAsGroup and
# fsGroup that mounts the fleet's shared volumes.
POD_USER: Final = 1000


def fleet_values() -> dict[str, str]:
    """The base's one place: the literals of its epd-fleet ConfigMap generator."""
    kustomization = yaml.safe_load(BASE_KUSTOMIZATION.read_text())
    [generator] = [g for g in kustomization["configMapGenerator"] if g["name"] == "epd-fleet"]
    return dict(literal.split("=", 1) for literal in generator["literals"])


def with_component(
    scratch: Path, component: str, overlay: str = "overlays/llm-d-e-p-d"
) -> list[dict[str, Any]]:
    return render_kustomization(
        scratch, namespace="epd", resources=[overlay], components=[f"components/{component}"]
    )


def deployment(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return of_kind(objects, "Deployment")[name]


def doc_section(title: str) -> str:
    """The text of the docs/deployment.md section of that heading, to the next heading of its level or
    above (a "#" line inside a code block is no heading)."""
    lines = DEPLOYMENT_DOC.read_text().splitlines()
    headings, fenced = {}, False
    for number, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#+ ", line):
            headings[number] = len(line) - len(line.lstrip("#"))
    [start] = [n for n in headings if lines[n].lstrip("#").strip() == title]
    end = next((n for n in headings if n > start and headings[n] <= headings[start]), len(lines))
    return "\n".join(lines[start + 1 : end]) + "\n"


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def shell_commands(text: str) -> list[str]:
    """The commands of a section's bash blocks, continuation lines joined, comments dropped; a heredoc
    stays inside the command that opens it."""
    commands: list[str] = []
    for block in code_blocks(text, "bash"):
        joined = block.replace("\\\n", " ")
        lines = iter(joined.splitlines())
        for line in lines:
            line = line.split(" # ")[0].rstrip() if not line.lstrip().startswith("#") else ""
            if not line.strip():
                continue
            heredoc = re.search(r"<<'?(\w+)'?", line)
            if heredoc:
                body = []
                for following in lines:
                    if following == heredoc[1]:
                        break
                    body.append(following)
                line = line + "\n" + "\n".join(body) + "\n" + heredoc[1]
            commands.append(line.strip())
    return commands


# --- Item 3: the claims get a network filesystem, made for each cloud ---------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_claim_names_its_class_and_never_falls_to_the_clusters_default_block_storage(
    overlay: str,
) -> None:
    """The claims named no storageClassName: on EKS, GKE and AKS the default class is block storage
    (ReadWriteOnce), and a ReadWriteMany claim on it stays Pending with nothing saying why. Every claim
    now names epd-rwx, which a storage component (or the operator) makes."""
    claims = of_kind(render(overlay), "PersistentVolumeClaim")
    assert set(claims) == {"epd-ec-cache", "epd-model-cache"}
    for name, claim in claims.items():
        assert claim["spec"].get("storageClassName") == "epd-rwx", name
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"], name


# The CSI drivers of each cloud's managed network filesystem, and what makes one speak NFS.
NETWORK_FILESYSTEMS: Final = {
    "efs.csi.aws.com": {},
    "filestore.csi.storage.gke.io": {},
    "file.csi.azure.com": {"protocol": "nfs"},
}


@pytest.mark.parametrize("component", STORAGE_COMPONENTS)
def test_each_cloud_component_makes_that_class_on_nfs_with_only_positive_lookups_cached(
    component: str, tmp_path: Path
) -> None:
    """Nothing said which network filesystem to use, nor what NFS's caching does to the middleware's
    check of a stored embedding. A component per cloud (EFS, Filestore, Azure Files over NFS) makes the
    class the claims name, with lookupcache=positive: with NFS's default a PD pod that once looked for
    an embedding's name and missed it (an image deleted by the cleanup, encoded again) keeps answering
    "missing" until its cached directory expires, up to a minute after an encoder wrote the file. Claims
    are retained: an embedding volume deleted by mistake is not gone with it."""
    assert {"storage-aws-efs", "storage-gke-filestore", "storage-azure-files-nfs"} <= set(STORAGE_COMPONENTS)
    objects = with_component(tmp_path, component, "base")
    [storage_class] = of_kind(objects, "StorageClass").values()
    assert storage_class["metadata"]["name"] == "epd-rwx"
    needed = NETWORK_FILESYSTEMS[storage_class["provisioner"]]
    assert needed.items() <= storage_class.get("parameters", {}).items()
    assert "lookupcache=positive" in storage_class["mountOptions"]
    assert not {"soft", "lookupcache=all", "noac"} & set(storage_class["mountOptions"])
    assert storage_class["reclaimPolicy"] == "Retain"
    section = doc_section("Storage: which network filesystem")
    assert f"components/{component}" in section
    assert "lookupcache=positive" in section


def test_the_efs_class_cannot_provision_until_the_operator_names_the_file_system(tmp_path: Path) -> None:
    """EFS's driver makes access points on a file system made outside Kubernetes: the component's id is
    no file system (a claim stays Pending with the driver's error in its events), and the docs give the
    commands that make one and the patch that names it."""
    [storage_class] = of_kind(with_component(tmp_path, "storage-aws-efs", "base"), "StorageClass").values()
    assert storage_class["parameters"]["fileSystemId"] == "fs-00000000"
    assert (storage_class["parameters"]["uid"], storage_class["parameters"]["gid"]) == (str(POD_USER),) * 2
    section = doc_section("Storage: which network filesystem")
    assert "aws efs create-file-system" in section
    assert "aws efs create-mount-target" in section
    assert "/parameters/fileSystemId" in section


def test_the_cleanup_and_the_docs_count_an_embeddings_age_from_its_last_use(tmp_path: Path) -> None:
    """The CronJob said its age counted from the encoder's write, docs/deployment.md from the last use.
    The middleware sets the file's time at each check before a request that uses it reaches an engine,
    so the docs were right: the CronJob's comment says so now, and the check is run here on a file."""
    storage = tmp_path / "ec"
    (storage / "hash-a").mkdir(parents=True)
    stored = storage / "hash-a" / EXAMPLE_CONNECTOR_FILE
    stored.write_bytes(b"x")
    written = time.time() - 3 * 3600
    os.utime(stored, (written, written))
    assert embedding_used(str(storage), "hash-a")
    assert stored.stat().st_mtime > time.time() - 60
    comment = " ".join(
        line.lstrip("# ")
        for line in (DEPLOY / "base" / "ec-cache-cleanup.yaml").read_text().splitlines()
        if line.startswith("#")
    )
    assert "the age counts from: the embedding's last use" in comment.lower()
    assert "when the encoder wrote it)" not in comment
    assert "**last use**" in doc_section("The EC storage and its cleanup")


@pytest.mark.parametrize(
    ("written_ago", "touched"),
    [(2.0, False), (FRESH_SECONDS + 5, True), (-3600.0, True)],
    ids=["written just now: its time already says used", "older: touched", "in the future: touched"],
)
def test_a_check_touches_an_embedding_only_when_its_time_does_not_already_say_now(
    tmp_path: Path, written_ago: float, touched: bool
) -> None:
    """The touch is a metadata write, a round trip to a shared file system's server on PD's event loop
    for each item: an embedding its encoder has just written (or a check has just touched) already reads
    as used now to a cleanup that counts in minutes. A time in the future (another clock) is not trusted."""
    (tmp_path / "hash-a").mkdir()
    stored = tmp_path / "hash-a" / EXAMPLE_CONNECTOR_FILE
    stored.write_bytes(b"x")
    written = time.time() - written_ago
    os.utime(stored, (written, written))
    assert embedding_used(str(tmp_path), "hash-a")
    assert (stored.stat().st_mtime != written) is touched
    if touched:
        assert abs(stored.stat().st_mtime - time.time()) < 60


def test_a_directory_or_nothing_by_the_embeddings_name_is_not_an_embedding(tmp_path: Path) -> None:
    (tmp_path / "hash-a" / EXAMPLE_CONNECTOR_FILE).mkdir(parents=True)
    assert not embedding_used(str(tmp_path), "hash-a")
    assert not embedding_used(str(tmp_path), "hash-b")
    assert not embedding_used(str(tmp_path), "../hash-a")


# --- Item 4: the decode pods call the prefill pods and nothing else, whatever the pod CIDR -------------


def scheduler_of(variables: dict[str, str], prefill_members: frozenset[tuple[str, int]]) -> Scheduler:
    config = EPDConfig.from_env({k: v for k, v in variables.items() if k.startswith("EPD_")})
    return Scheduler(
        config.scheduler_allow,
        config.scheduler_scheme,
        lambda: frozenset(),
        lambda: prefill_members,
        Stats(),
        max_encoders=config.max_media_items,
    )


@pytest.mark.parametrize(
    "pod_cidr",
    [
        "10.0.0.0/8",  # the old guess
        "100.64.0.0/16",  # EKS with custom networking (VPC CNI on a secondary CIDR)
        "192.168.0.0/16",  # EKS on a 192.168 VPC; Calico's default pool
        "10.244.0.0/16",  # AKS kubenet, and most kubeadm clusters
        "172.16.0.0/14",  # a GKE VPC-native secondary range
    ],
)
def test_decode_pods_call_only_the_prefill_pods_whatever_the_pod_cidr(pod_cidr: str) -> None:
    """The E/P/D overlay admitted prefill targets by a guessed network, 10.0.0.0/8:8000: on any other pod
    CIDR every request got 403, and where it was right every pod of the cluster on port 8000 could be
    named. The decode pods now admit the members of their prefill pool: the headless Service of the
    prefill pods, on vLLM's port, its addresses published before the pods are ready (so the picker can
    never name a pod the decode pods have not seen yet). The same rendered configuration admits a prefill
    pod on every pod network and refuses another pod, another port and a pod outside the pool."""
    objects = render("overlays/llm-d-e-p-d")
    decode, prefill = deployment(objects, "epd-pd"), deployment(objects, "epd-prefill")
    variables = env(decode)
    assert "EPD_SCHEDULER_ALLOW" not in variables
    [pool] = EPDConfig.from_env({k: v for k, v in variables.items() if k.startswith("EPD_")}).prefill
    service_name, port = re.fullmatch(r"dns\+http://([a-z0-9-]+):(\d+)", pool).groups()  # type: ignore[union-attr]
    service = of_kind(objects, "Service")[service_name]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    chosen = [d for d in vllm_servers(objects) if selects(service["spec"]["selector"], pod_labels(d))]
    assert [d["metadata"]["name"] for d in chosen] == ["epd-prefill"]
    [service_port] = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
    named = {p["name"]: p["containerPort"] for p in container(prefill)["ports"]}
    assert named[service_port["targetPort"]] == int(port) == vllm_port(prefill)

    network = ipaddress.ip_network(pod_cidr)
    hosts = network.hosts()
    prefill_pod, other_pod = str(next(hosts)), str(next(hosts))
    scheduler = scheduler_of(variables, frozenset({(prefill_pod, int(port))}))
    route = scheduler.route([(b"x-prefiller-host-port", f"{prefill_pod}:{port}".encode())])
    assert route.prefill is not None
    assert prefill_pod in route.prefill
    for forged in (f"{other_pod}:{port}", f"{prefill_pod}:{named['nixl']}", f"{prefill_pod}:9090"):
        with pytest.raises(ForbiddenTarget):
            scheduler.route([(b"x-prefiller-host-port", forged.encode())])


def test_no_manifest_admits_scheduler_targets_by_a_network_guess() -> None:
    """No overlay sets EPD_SCHEDULER_ALLOW (a network would admit every pod of it on that port), and the
    old guess is written nowhere in the manifests."""
    for overlay in OVERLAYS:
        for server in vllm_servers(render(overlay)):
            assert "EPD_SCHEDULER_ALLOW" not in env_entries(container(server)), (overlay, server)
    for path in DEPLOY.rglob("*.yaml"):
        assert "10.0.0.0/8" not in path.read_text(), path


# --- Item 5: the model and the connectors are written once ------------------------------------------


def scalars(node: Any) -> list[str]:
    """Every string a YAML document holds, keys and values."""
    if isinstance(node, dict):
        return [s for key, value in node.items() for s in (*scalars(key), *scalars(value))]
    if isinstance(node, list):
        return [s for item in node for s in scalars(item)]
    return [node] if isinstance(node, str) else []


def test_the_model_and_the_connectors_are_written_once_in_the_manifests() -> None:
    """The model and the connector config were copied by hand into four manifests (the decode patch
    among them), so a model changed in one was not changed in the others and PD refused its encoders.
    Each is now one literal of the base's (or, for the KV connector, the E/P/D overlay's) epd-fleet
    ConfigMap, and no other value in deploy/kubernetes names it."""
    values = fleet_values()
    assert values.keys() == {"model", "ec-connector", "ec-connector-extra-config"}
    written: list[str] = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            written += scalars(document)
    for needle in (values["model"], values["ec-connector"], "NixlConnector", "shared_storage_path"):
        holders = [s for s in written if needle in s]
        assert len(holders) == 1, (needle, holders)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_vllm_server_reads_the_model_and_the_connectors_from_the_fleets_configmap(overlay: str) -> None:
    """As written (before the kubelet expands them), every vLLM server's model argument and connector
    settings are $(FLEET_...) references to variables from the one ConfigMap's keys."""
    objects = render(overlay, as_run=False)
    [fleet] = [cm for name, cm in of_kind(objects, "ConfigMap").items() if name.startswith("epd-fleet-")]
    for server in vllm_servers(objects):
        name, item = server["metadata"]["name"], container(server)
        assert item["args"][0] == "$(FLEET_MODEL)", name
        ec = item["args"][item["args"].index("--ec-transfer-config") + 1]
        assert '"ec_connector":"$(FLEET_EC_CONNECTOR)"' in ec, name
        assert '"ec_connector_extra_config":$(FLEET_EC_CONNECTOR_EXTRA_CONFIG)' in ec, name
        referenced = {word for arg in item["args"] for word in re.findall(r"\$\((FLEET_\w+)\)", arg)}
        entries = env_entries(item)
        for variable in referenced:
            reference = entries[variable]["valueFrom"]["configMapKeyRef"]
            assert reference["name"] == fleet["metadata"]["name"], (name, variable)
            assert reference["key"] in fleet["data"], (name, variable)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_model_changed_in_one_place_reaches_every_server_of_the_overlay(
    overlay: str, tmp_path: Path
) -> None:
    """An operator's overlay merges one literal into epd-fleet: every encoder, PD, decode and prefill
    server then runs that model (the decode pods too: their patch no longer re-lists the args), with
    the connectors unchanged, and every one of them rolls (the ConfigMap's name hash changes)."""
    before = {d["metadata"]["name"]: d for d in vllm_servers(render(overlay))}
    objects = render_kustomization(
        tmp_path,
        resources=[overlay],
        configMapGenerator=[
            {"name": "epd-fleet", "behavior": "merge", "literals": ["model=acme/Other-VL-7B-Instruct"]}
        ],
    )
    servers = list(vllm_servers(objects))
    assert {d["metadata"]["name"] for d in servers} == set(before)
    for server in servers:
        name, args = server["metadata"]["name"], container(server)["args"]
        assert args[0] == "acme/Other-VL-7B-Instruct", name
        assert flag_json(args, "--ec-transfer-config")["ec_connector"] == fleet_values()["ec-connector"]
        old_refs = {
            e["valueFrom"]["configMapKeyRef"]["name"]
            for e in container(before[name])["env"]
            if "configMapKeyRef" in e.get("valueFrom", {})
        }
        new_refs = {
            e["valueFrom"]["configMapKeyRef"]["name"]
            for e in container(server)["env"]
            if "configMapKeyRef" in e.get("valueFrom", {})
        }
        assert old_refs.isdisjoint(new_refs), name  # a new name: the pod template changed, pods roll


def test_the_decode_pods_run_the_base_pd_server_and_only_add_the_kv_connector() -> None:
    """patch-decode.yaml re-listed PD's whole args, so a later change to the base never reached the
    decode pods. The decode pods now run the base PD server's args followed by the KV connector's flag
    alone, and keep every one of its variables, probes, resources and volumes."""
    pd = deployment(render("base"), "epd-pd")
    decode = deployment(render("overlays/llm-d-e-p-d"), "epd-pd")
    base_item, decode_item = container(pd), container(decode)
    added = decode_item["args"][len(base_item["args"]) :]
    assert decode_item["args"][: len(base_item["args"])] == base_item["args"]
    assert added[0] == "--kv-transfer-config"
    assert json.loads(added[1])["kv_role"] in ("kv_consumer", "kv_both")
    assert len(added) == 2
    base_env, decode_env = env_entries(base_item), env_entries(decode_item)
    for name, entry in base_env.items():
        if "configMapKeyRef" in entry.get("valueFrom", {}):
            assert (
                decode_env[name]["valueFrom"]["configMapKeyRef"]["key"]
                == (entry["valueFrom"]["configMapKeyRef"]["key"])
            )
        else:
            assert decode_env[name] == entry, name
    assert set(decode_env) - set(base_env) == {
        "EPD_PREFILL",
        "EPD_SCHEDULER",
        "FLEET_KV_TRANSFER_CONFIG",
        "VLLM_NIXL_SIDE_CHANNEL_HOST",
    }
    for field in (
        "startupProbe",
        "readinessProbe",
        "livenessProbe",
        "resources",
        "volumeMounts",
        "lifecycle",
    ):
        assert decode_item[field] == base_item[field], field


def every_render(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, list[dict[str, Any]]]]:
    renders = [(overlay, render(overlay)) for overlay in OVERLAYS]
    for component in COMPONENTS:
        renders.append((f"components/{component}", with_component(tmp_path_factory.mktemp("c"), component)))
    return renders


@pytest.fixture(scope="module")
def renders(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, list[dict[str, Any]]]]:
    return every_render(tmp_path_factory)


def test_every_configmap_a_pod_reads_is_rendered_beside_it_with_the_key(
    renders: list[tuple[str, list[dict[str, Any]]]],
) -> None:
    """A reference kustomize did not rename (a generator outside the pods' namespace, a key misspelt)
    keeps a pod from starting: every configMapKeyRef, envFrom and configMap volume of every overlay and
    component names a ConfigMap rendered in the pod's namespace, with the key."""
    for where, objects in renders:
        config_maps = {
            (obj["metadata"].get("namespace"), obj["metadata"]["name"]): obj
            for obj in objects
            if obj["kind"] == "ConfigMap"
        }
        for obj in objects:
            if obj["kind"] not in ("Deployment", "CronJob"):
                continue
            namespace = obj["metadata"].get("namespace")
            spec = (
                obj["spec"]["template"]["spec"]
                if obj["kind"] == "Deployment"
                else (obj["spec"]["jobTemplate"]["spec"]["template"]["spec"])
            )
            for item in containers(spec):
                for entry in item.get("env", []):
                    reference = entry.get("valueFrom", {}).get("configMapKeyRef")
                    if reference:
                        found = config_maps.get((namespace, reference["name"]))
                        assert found is not None, (where, obj["metadata"]["name"], reference)
                        assert reference["key"] in found["data"], (where, reference)
                for source in item.get("envFrom", []):
                    if "configMapRef" in source:
                        assert (namespace, source["configMapRef"]["name"]) in config_maps, (where, source)
            for volume in spec.get("volumes", []):
                if "configMap" in volume:
                    assert (namespace, volume["configMap"]["name"]) in config_maps, (where, volume)


# --- Item 6: workloads and their controllers --------------------------------------------------------


def test_no_workload_sets_replicas_beside_an_hpa_that_scales_it(
    renders: list[tuple[str, list[dict[str, Any]]]],
) -> None:
    """replicas: 2 stood beside the HPAs: every kubectl apply reset the scale the HPA had chosen (and
    stopped the pods above it). A Deployment an HPA scales now has no replicas field; one without an HPA
    (the picker) keeps its own."""
    for where, objects in renders:
        scaled = {
            hpa["spec"]["scaleTargetRef"]["name"]
            for hpa in of_kind(objects, "HorizontalPodAutoscaler").values()
            if hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
        }
        for name, workload in of_kind(objects, "Deployment").items():
            if name in scaled:
                assert "replicas" not in workload["spec"], (where, name)
            else:
                assert workload["spec"].get("replicas") == 1, (where, name)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_gpu_workload_rolls_one_pod_at_a_time_without_a_surge_pod(overlay: str) -> None:
    """No rollout strategy: the default surge (25 %, at least one pod) asks for a GPU a full node pool
    does not have, and the rollout waited on a Pending pod until its deadline. Every vLLM Deployment now
    stops one pod before it starts its replacement."""
    for server in vllm_servers(render(overlay)):
        strategy = server["spec"]["strategy"]
        assert strategy["type"] == "RollingUpdate", server["metadata"]["name"]
        assert strategy["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}, server["metadata"]["name"]
    assert "maxSurge 0" in doc_section("Rollouts, scale and placement")


def test_the_prefill_servers_have_a_disruption_budget_and_an_autoscaler() -> None:
    """The prefill pods had neither: a drain could take them all at once, and they never scaled. Their
    budget takes one at a time; their HPA scales on the prefill calls in flight the decode pods see (an
    external metric the adapter serves: tests/test_deploy.py), per prefill replica."""
    objects = render("overlays/llm-d-e-p-d")
    prefill = deployment(objects, "epd-prefill")
    pdb = of_kind(objects, "PodDisruptionBudget")["epd-prefill"]
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(prefill))
    assert pdb["spec"]["maxUnavailable"] == 1
    hpa = of_kind(objects, "HorizontalPodAutoscaler")["epd-prefill"]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "epd-prefill",
    }
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    [metric] = hpa["spec"]["metrics"]
    assert metric["external"]["metric"]["name"] == "epd_prefill_in_flight"
    assert metric["external"]["target"]["type"] == "AverageValue"
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_disruption_budget_lets_a_broken_pod_be_evicted(overlay: str) -> None:
    """With the default policy, pods that never became ready (a model that does not load) spend the
    budget and a node drain hangs on them. Every budget lets a broken pod go."""
    for name, pdb in of_kind(render(overlay), "PodDisruptionBudget").items():
        assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow", name


def test_the_placement_component_gives_every_vllm_server_each_gpu_hook(tmp_path: Path) -> None:
    """No hooks for tolerations, nodeSelector, runtimeClass, anti-affinity or topology spread. One
    component gives every vLLM server all five, each server's anti-affinity and spread counted on its
    own pods, and leaves the picker and the cleanup job alone."""
    objects = with_component(tmp_path, "gpu-placement")
    for server in vllm_servers(objects):
        name, spec = server["metadata"]["name"], server["spec"]["template"]["spec"]
        assert spec["runtimeClassName"], name
        assert spec["nodeSelector"], name
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"]), name
        [term] = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        assert label_selector_matches(term["podAffinityTerm"]["labelSelector"], pod_labels(server)), name
        others = [d for d in vllm_servers(objects) if d is not server]
        assert not any(
            label_selector_matches(term["podAffinityTerm"]["labelSelector"], pod_labels(d)) for d in others
        ), name
        [spread] = spec["topologySpreadConstraints"]
        assert spread["topologyKey"] == "topology.kubernetes.io/zone"
        assert "app.kubernetes.io/name" in spread["matchLabelKeys"]
    epp = deployment(objects, "epd-epp")["spec"]["template"]["spec"]
    assert not {"runtimeClassName", "nodeSelector", "tolerations", "affinity"} & set(epp)
    assert "components/gpu-placement" in doc_section("Rollouts, scale and placement")


# --- Item 7: a fleet from nothing --------------------------------------------------------------------


FROM_NOTHING: Final = "A fleet from nothing"


def fleet_overlay(topology: str, storage: str) -> tuple[dict[str, Any], str]:
    """The docs' own overlay (the heredoc of `cat > fleet/kustomization.yaml`), with the variables the
    docs set filled in for a topology and a cloud's storage."""
    [command] = [c for c in shell_commands(doc_section(FROM_NOTHING)) if "> fleet/kustomization.yaml" in c]
    body = command.split("\n", 1)[1].rsplit("\n", 1)[0]
    values = {
        "REGISTRY": "registry.example.com/ml",
        "DIGEST": "sha256:" + "1" * 64,
        "BUSYBOX_DIGEST": "sha256:" + "2" * 64,
        "TOPOLOGY": topology,
        "STORAGE": storage,
    }
    used = set(re.findall(r"\$\{?(\w+)\}?", body))
    assert used <= values.keys(), used - values.keys()
    for name, value in values.items():
        body = re.sub(rf"\$\{{{name}\}}|\${name}\b", value, body)
    return yaml.safe_load(body), body


def test_the_docs_give_a_fleet_from_nothing_in_commands() -> None:
    """No copy-paste path: no namespace step, no kubectl apply -k, no Gateway, a placeholder image, no
    smoke request and no benchmark. The docs' section is now the whole path, in order: build and push the
    image and read its digest, make the namespace and the Secret, write an overlay of one's own, render
    and apply it, wait for the rollouts, check the fleet, send a chat request with an image, measure."""
    commands = shell_commands(doc_section(FROM_NOTHING))
    order = [
        "docker buildx imagetools inspect vllm/vllm-openai",
        "docker build -f deploy/docker/Dockerfile",
        "docker push",
        "docker buildx imagetools inspect $REGISTRY",
        "kubectl create namespace epd",
        "kubectl -n epd create secret generic epd-secrets",
        "cat > fleet/kustomization.yaml",
        "kubectl kustomize fleet",
        "kubectl apply -k fleet",
        "kubectl -n epd rollout status",
        "epd-middleware check --pd http://127.0.0.1:8000 --canary",
        "curl",
        "vllm bench serve",
    ]
    found = [next((i for i, c in enumerate(commands) if step in c), None) for step in order]
    assert None not in found, [step for step, at in zip(order, found, strict=True) if at is None]
    assert found == sorted(found), list(zip(order, found, strict=True))


@pytest.mark.parametrize("storage", STORAGE_COMPONENTS)
@pytest.mark.parametrize("topology", ["base", "overlays/llm-d-e-pd", "overlays/llm-d-e-p-d"])
def test_the_docs_overlay_renders_a_whole_fleet_pinned_by_digest(
    topology: str, storage: str, tmp_path: Path
) -> None:
    """The overlay the docs write renders for every topology and cloud: the namespace the commands made,
    the storage class the claims name, the vLLM image the operator pushed, by digest, and nothing left
    by tag but what the docs say to pin next."""
    kustomization, _ = fleet_overlay(topology, storage)
    fleet = tmp_path / "fleet"
    fleet.mkdir()
    # The docs' overlay sits in the checkout's root: its paths start ../deploy/.
    for key in ("resources", "components"):
        kustomization[key] = [
            os.path.relpath(PROJECT / path.removeprefix("../"), fleet) for path in kustomization.get(key, [])
        ]
    (fleet / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    objects = render(fleet)
    assert of_kind(objects, "StorageClass")["epd-rwx"]
    for obj in objects:
        if obj["kind"] not in ("StorageClass", "ClusterRole", "ClusterRoleBinding"):
            assert obj["metadata"]["namespace"] == "epd", obj["metadata"]["name"]
    images = {item["image"] for _, spec in pod_specs(objects) for item in containers(spec)}
    assert "registry.example.com/ml/epd-vllm-openai@sha256:" + "1" * 64 in images
    assert "busybox@sha256:" + "2" * 64 in images
    for image in images:
        assert "@sha256:" in image or image.startswith("ghcr.io/llm-d/"), image


def smoke_request() -> tuple[str, dict[str, Any]]:
    """The docs' chat request: a printf of the body (the image's base64 as its one %s, which no argument
    list could hold) piped into curl, which reads it from stdin."""
    [command] = [
        c for c in shell_commands(doc_section(FROM_NOTHING)) if "/v1/chat/completions" in c and "curl" in c
    ]
    writer, reader = (shlex.split(part) for part in command.split(" | "))
    assert writer[0] == "printf"
    assert reader[reader.index("-d") + 1] == "@-"
    url = next(w for w in reader if w.startswith("http"))
    body = json.loads(writer[1] % "aGVsbG8=")
    return url, body


def test_the_smoke_request_is_an_openai_chat_request_with_an_image_for_the_fleets_model() -> None:
    """vLLM's own examples end with a chat request; ours had none. The docs' request is an OpenAI chat
    completion to the PD servers, for the fleet's model, with an image the middleware sends to an
    encoder (a data URL: no egress needed), and the docs say how to see that it was encoded remotely."""
    url, body = smoke_request()
    assert url.endswith("/v1/chat/completions")
    assert body["model"] == fleet_values()["model"]
    [message] = body["messages"]
    kinds = [part["type"] for part in message["content"]]
    assert kinds.count("image_url") == 1
    assert "text" in kinds
    assert "epd_requests_total" in doc_section(FROM_NOTHING)


def test_the_benchmark_measures_the_fleet_through_chat_requests_with_images() -> None:
    """vLLM's own examples measure with vllm bench serve: the docs' command does, through the chat
    endpoint (the one the middleware intercepts), with synthetic images, for the fleet's model."""
    [command] = [c for c in shell_commands(doc_section(FROM_NOTHING)) if "vllm bench serve" in c]
    words = shlex.split(command.split("vllm bench serve", 1)[1])
    options = {w: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--")}
    assert options["--backend"] == "openai-chat"
    assert options["--endpoint"] == "/v1/chat/completions"
    assert options["--dataset-name"] == "random-mm"
    assert options["--model"] == fleet_values()["model"]
    assert json.loads(options["--random-mm-limit-mm-per-prompt"])["image"] >= 1
    assert ast.literal_eval(options["--random-mm-bucket-config"])


def test_the_base_image_is_one_no_registry_can_serve() -> None:
    """The image was ghcr.io/example/...: a name on a real registry that anyone owning that namespace
    could publish under, and a fleet applied unchanged would run it. The base names a domain that can
    never resolve (RFC 2606's .invalid): unchanged, the pull fails with that name in the event."""
    images = {item["image"] for _, spec in pod_specs(render("base")) for item in containers(spec)}
    [vllm] = [image for image in images if "epd-vllm" in image]
    assert vllm.split("/")[0].endswith(".invalid")
    assert not any("example" in image for image in images)


def test_the_readme_installs_the_package_from_where_it_is_published() -> None:
    """The README's pip install named "epd-middleware[metrics]", a package no index has: every install
    it gives is now of a checkout or of the repository."""
    for command in re.findall(r"pip install ([^`\n]*)", README.read_text()):
        target = shlex.split(command)[-1] if not command.startswith('"') else shlex.split(command)[0]
        assert target.startswith((".", "git+")) or " @ git+" in target, command


# --- Item 8: the picker as the Inference Extension's chart has it ------------------------------------

# Resources that are not namespaced: a Role granting them grants nothing.
CLUSTER_SCOPED: Final = {
    ("authentication.k8s.io", "tokenreviews"),
    ("authorization.k8s.io", "subjectaccessreviews"),
    ("", "nodes"),
    ("", "namespaces"),
    ("", "persistentvolumes"),
    ("storage.k8s.io", "storageclasses"),
}


@pytest.mark.parametrize("overlay", ["overlays/llm-d-e-pd", "overlays/llm-d-e-p-d"])
def test_the_pickers_token_and_access_reviews_come_from_a_cluster_role_bound_to_it(overlay: str) -> None:
    """tokenreviews and subjectaccessreviews stood in a namespaced Role, where they are dead (both are
    cluster-scoped): the picker's /metrics could authorize no scraper. A ClusterRole now grants them and a
    ClusterRoleBinding gives it to the picker's ServiceAccount, in the fleet's namespace; no Role names a
    cluster-scoped resource."""
    objects = render(overlay)
    for name, role in of_kind(objects, "Role").items():
        for rule in role["rules"]:
            granted = {(group, resource) for group in rule["apiGroups"] for resource in rule["resources"]}
            assert not granted & CLUSTER_SCOPED, (name, granted & CLUSTER_SCOPED)
    epp = deployment(objects, "epd-epp")
    account = epp["spec"]["template"]["spec"]["serviceAccountName"]
    [binding] = of_kind(objects, "ClusterRoleBinding").values()
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": epp["metadata"]["namespace"]}
    ]
    cluster_role = of_kind(objects, "ClusterRole")[binding["roleRef"]["name"]]
    granted = {
        (group, resource, verb)
        for rule in cluster_role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == {
        ("authentication.k8s.io", "tokenreviews", "create"),
        ("authorization.k8s.io", "subjectaccessreviews", "create"),
    }


@pytest.mark.parametrize("overlay", ["overlays/llm-d-e-pd", "overlays/llm-d-e-p-d"])
def test_the_picker_is_replaced_not_rolled(overlay: str) -> None:
    """One picker on RollingUpdate: old and new ran side by side with diverging state. Recreate, as the
    Inference Extension's chart deploys it."""
    epp = deployment(render(overlay), "epd-epp")
    assert epp["spec"]["strategy"] == {"type": "Recreate"}
    assert epp["spec"]["replicas"] == 1


def test_the_istio_gateway_reaches_the_picker_over_tls_and_the_other_gateways_drop_the_rule(
    tmp_path: Path,
) -> None:
    """Istio was listed and its DestinationRule was not shipped: Istio's gateway spoke plaintext to the
    picker's TLS port. The overlay's Gateway is Istio's, with the rule for the picker's Service (TLS, the
    picker's own certificate); each gateway component switches the class and drops the rule, which
    without Istio has no CRD to be applied to."""
    objects = render("overlays/llm-d-e-pd")
    [gateway] = of_kind(objects, "Gateway").values()
    assert gateway["spec"]["gatewayClassName"] == "istio"
    [rule] = of_kind(objects, "DestinationRule").values()
    [epp_service] = [s for name, s in of_kind(objects, "Service").items() if name == "epd-epp"]
    assert rule["spec"]["host"] in (
        epp_service["metadata"]["name"],
        f"{epp_service['metadata']['name']}.{epp_service['metadata']['namespace']}.svc.cluster.local",
    )
    assert rule["spec"]["trafficPolicy"]["tls"] == {"mode": "SIMPLE", "insecureSkipVerify": True}
    assert GATEWAY_COMPONENTS
    for component in GATEWAY_COMPONENTS:
        (tmp_path / component).mkdir()
        switched = with_component(tmp_path / component, component)
        [other] = of_kind(switched, "Gateway").values()
        assert other["spec"]["gatewayClassName"] not in ("istio", "")
        assert not of_kind(switched, "DestinationRule"), component


def test_on_gke_the_load_balancer_waits_as_long_as_the_route(tmp_path: Path) -> None:
    """GKE's backend timeout (30 s by default) would cut long generations whatever the HTTPRoute says:
    the GKE component's backend policy waits as long as the route, and its health check reads vLLM's
    /health on the pool's target port."""
    objects = with_component(tmp_path, "gateway-gke")
    [route] = of_kind(objects, "HTTPRoute").values()
    [pool] = of_kind(objects, "InferencePool").values()
    [backend] = of_kind(objects, "GCPBackendPolicy").values()
    [health] = of_kind(objects, "HealthCheckPolicy").values()
    [rule] = route["spec"]["rules"]
    assert f"{backend['spec']['default']['timeoutSec']}s" == rule["timeouts"]["request"]
    for policy in (backend, health):
        assert policy["spec"]["targetRef"]["name"] == pool["metadata"]["name"]
    check = health["spec"]["default"]["config"]["httpHealthCheck"]
    assert check["requestPath"] == "/health"
    assert check["port"] in {p["number"] for p in pool["spec"]["targetPorts"]}


# --- Item 10: the adapter's rules are merged, never a whole configuration -----------------------------


def test_nothing_in_the_adapters_directory_can_replace_its_configuration() -> None:
    """kubectl apply -k deploy/kubernetes/prometheus-adapter replaced the adapter's whole config, kubectl
    top's and CPU HPAs' resource rules included. The directory now holds the rules as values of the
    adapter's Helm chart: nothing there renders or applies (no kustomization, no Kubernetes object), and
    the values name only the chart's lists of custom and external rules, so its default rules and its
    resource rules stay as they are."""
    directory = ADAPTER_VALUES.parent
    assert not (directory / "kustomization.yaml").exists()
    for path in directory.rglob("*.y*ml"):
        for document in yaml.safe_load_all(path.read_text()):
            assert not (isinstance(document, dict) and "apiVersion" in document), path
    values = yaml.safe_load(ADAPTER_VALUES.read_text())
    assert values.keys() == {"rules"}
    assert values["rules"].keys() == {"custom", "external"}  # not default, resource or existing
    section = doc_section("Autoscaling: the adapter's rules")
    assert "--reuse-values -f deploy/kubernetes/prometheus-adapter/values.yaml" in section
    assert "resourceRules" in section


def test_the_values_merged_as_helm_merges_them_keep_the_charts_default_and_resource_rules() -> None:
    """Helm merges maps and replaces lists: the chart's rules.default and rules.resource (kubectl top,
    CPU HPAs) come through a merge with these values untouched, and the lists are these rules."""

    def merge(into: Any, values: Any) -> Any:
        if isinstance(into, dict) and isinstance(values, dict):
            return {
                key: merge(into.get(key), values.get(key)) if key in values else into[key]
                for key in {*into, *values}
            }
        return values

    chart_defaults = {
        "rules": {
            "default": True,
            "custom": [],
            "external": [],
            "resource": {"cpu": {"containerQuery": "sum(rate(container_cpu_usage_seconds_total[3m]))"}},
        }
    }
    merged = merge(chart_defaults, yaml.safe_load(ADAPTER_VALUES.read_text()))
    assert merged["rules"]["default"] is True
    assert merged["rules"]["resource"] == chart_defaults["rules"]["resource"]
    assert merged["rules"]["external"] == adapter_rules()["external"]


# --- Item 11: traces, wired from one place ---------------------------------------------------------


def test_tracing_reaches_every_vllm_server_from_one_endpoint_with_a_parent_based_sampler(
    tmp_path: Path,
) -> None:
    """Nothing in the manifests wired --otlp-traces-endpoint. The tracing component gives every vLLM
    server (encoders, decode, prefill: one request is one trace across them) the flag, expanded from one
    ConfigMap's endpoint, a parent-based ratio sampler (a request's sampling decision travels with it to
    the encoders and prefill servers) and a service name per role; the picker is not a vLLM server."""
    objects = with_component(tmp_path, "tracing")
    [tracing] = [cm for name, cm in of_kind(objects, "ConfigMap").items() if name.startswith("epd-tracing-")]
    settings = tracing["data"]
    assert settings["OTEL_TRACES_SAMPLER"].startswith("parentbased_")
    assert 0 < float(settings["OTEL_TRACES_SAMPLER_ARG"]) <= 1
    for server in vllm_servers(objects):
        name, item = server["metadata"]["name"], container(server)
        assert f"--otlp-traces-endpoint={settings['OTEL_EXPORTER_OTLP_TRACES_ENDPOINT']}" in item["args"], (
            name
        )
        assert [s["configMapRef"]["name"] for s in item["envFrom"]] == [tracing["metadata"]["name"]]
        service = env_entries(item)["OTEL_SERVICE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert service == "metadata.labels['app.kubernetes.io/name']"
        assert pod_labels(server)["app.kubernetes.io/name"] == name
    assert "envFrom" not in container(deployment(objects, "epd-epp"), "epp")


def test_the_docs_give_sampling_advice_and_the_host_a_server_outside_vllm_needs() -> None:
    """Tracing outside vLLM needed an undocumented Host(traces=True). The docs' traces section gives the
    component, the sampler and its ratio, and the Python a Starlette or FastAPI server runs, which is
    run here: the middleware it builds traces, with every other fact the options give kept."""
    section = doc_section("Traces")
    assert "components/tracing" in section
    assert "OTEL_TRACES_SAMPLER=parentbased_traceidratio" in section
    assert "OTEL_TRACES_SAMPLER_ARG" in section
    blocks = [block for block in code_blocks(section, "python") if "Host.outside" in block]
    [snippet] = blocks
    scope: dict[str, Any] = {}
    previous = os.environ.get("EPD_ENCODERS")
    os.environ["EPD_ENCODERS"] = "http://enc-0:8001"
    try:
        exec(compile(snippet, "docs/deployment.md", "exec"), scope)
    finally:
        if previous is None:
            del os.environ["EPD_ENCODERS"]
        else:
            os.environ["EPD_ENCODERS"] = previous
    [middleware] = [m for m in scope["app"].user_middleware if m.cls is EPDMiddleware]
    host = middleware.kwargs["host"]
    assert host.traces is True
    assert host == replace(Host.outside(middleware.kwargs["config"]), traces=True)


# --- Item 12: images by digest in one place, the image's user the pods' --------------------------------


def kustomizations() -> list[Path]:
    return sorted(DEPLOY.rglob("kustomization.yaml"))


def images_entries() -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for path in kustomizations():
        for entry in yaml.safe_load(path.read_text()).get("images", []):
            found.setdefault(entry["name"], []).append(path)
    return found


def test_no_manifest_names_an_image_by_tag_outside_the_images_entries() -> None:
    """Images were pinned by tag in four places. Every manifest now names its images without a tag or a
    digest, and each image has exactly one images: entry, the one place its tag (or the operator's digest)
    is written."""
    entries = images_entries()
    for name, paths in entries.items():
        assert len(paths) == 1, (name, paths)
    for path in sorted(DEPLOY.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for document in yaml.safe_load_all(path.read_text()):
            is_object = isinstance(document, dict) and {"kind", "metadata"} <= document.keys()
            workloads = [document] if is_object else []
            for _, spec in pod_specs(workloads):
                for item in [*spec.get("containers", []), *spec.get("initContainers", [])]:
                    if "image" not in item:  # a patch of another field
                        continue
                    image = item["image"]
                    assert "@" not in image, (path, image)
                    assert ":" not in image.rsplit("/", 1)[-1], (path, image)
                    assert image in entries, (path, image)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_image_comes_from_its_images_entry(overlay: str) -> None:
    """What the kubelet pulls is the entry's image, with the entry's tag: no pod renders with an image
    no entry names, nor with no tag at all (the registry's latest)."""
    renamed = {
        entry.get("newName", entry["name"]): entry
        for path in kustomizations()
        for entry in yaml.safe_load(path.read_text()).get("images", [])
    }
    for _, spec in pod_specs(render(overlay)):
        for item in containers(spec):
            name, _, tag = item["image"].partition("@")[0].rpartition(":")
            assert name in renamed, item["image"]
            assert tag == renamed[name]["newTag"], item["image"]


def test_the_docs_say_where_each_digest_comes_from() -> None:
    section = doc_section("Images by digest")
    for command in (
        "docker buildx imagetools inspect",
        "kustomize edit set image",
        "--build-arg VLLM_IMAGE=",
    ):
        assert command in section, command
    for name in images_entries():
        assert name in section, name
    assert "--build-arg VLLM_IMAGE=vllm/vllm-openai:v0.32.0@sha256:" in DOCKERFILE.read_text()


def dockerfile_instructions() -> list[str]:
    joined = DOCKERFILE.read_text().replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def test_the_image_runs_as_the_pods_user_with_a_name_and_a_home() -> None:
    """No USER was set: docker run ran vLLM as root, and uid 1000 (the pods' runAsUser) had no passwd
    entry, which torch's import-time getpass.getuser() fails on (vLLM issue #44548). The image now gives
    uid 1000 a name and a home (keeping one the base has) and ends as that numeric user, so the kubelet
    can check runAsNonRoot against it; its HOME is the pods' HOME."""
    instructions = dockerfile_instructions()
    users = [line.split()[1] for line in instructions if line.startswith("USER ")]
    assert users[-1] == f"{POD_USER}:{POD_USER}"
    assert instructions[-1].startswith("USER ")
    [made] = [line for line in instructions if "useradd" in line]
    assert f"getent passwd {POD_USER} > /dev/null || useradd --uid {POD_USER}" in made
    assert f"getent group {POD_USER} > /dev/null || groupadd --gid {POD_USER}" in made
    assert f"pwd.getpwuid({POD_USER})" in made
    [home] = [line.split("=", 1)[1] for line in instructions if line.startswith("ENV HOME=")]
    for server in vllm_servers(render("base")):
        assert env(server)["HOME"] == home
    # The build's own steps (pip, its checks) run before the user changes: they write the image.
    pip = next(i for i, line in enumerate(instructions) if "pip install" in line)
    assert pip < next(i for i, line in enumerate(instructions) if line.startswith("USER "))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_of_the_fleet_runs_as_the_images_user(overlay: str) -> None:
    """runAsUser, runAsGroup and fsGroup agree on every pod that touches the fleet's volumes (every vLLM
    server, and the cleanup job that deletes their files) and with the image's USER; the picker runs its
    own image's non-root user and mounts none of them."""
    for where, spec in pod_specs(render(overlay)):
        claims = {
            v["persistentVolumeClaim"]["claimName"]
            for v in spec.get("volumes", [])
            if "persistentVolumeClaim" in v
        }
        context = spec["securityContext"]
        if claims:
            assert (context["runAsUser"], context["runAsGroup"], context["fsGroup"]) == (POD_USER,) * 3, where
        else:
            assert context["runAsUser"] != 0, where


# --- Item 13: the README says what was run and what was read -------------------------------------------


def test_the_readme_says_near_the_top_that_the_gpu_and_kubernetes_paths_were_rendered_and_read_not_run() -> (
    None
):
    """The README's GPU section did not say that the GPU and Kubernetes paths were rendered and read, not
    run. Its first screen says so plainly, and what was run (real vLLM on a CPU)."""
    top = "\n".join(README.read_text().splitlines()[:25])
    statement = re.search(r"\*\*What was run and what was read\.\*\*(.*?)(\n\n|$)", top, flags=re.DOTALL)
    assert statement is not None
    text = " ".join(statement[1].split())
    for phrase in ("CPU", "GPU", "Kubernetes", "rendered", "read", "not run"):
        assert phrase in text, phrase
