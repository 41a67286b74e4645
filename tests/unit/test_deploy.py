"""Deployment files: Kubernetes manifests against the API schema (kubernetes-validate, strict),
plus what the schema cannot say (shared memory, keys, probes, scraping, the balancer's config);
the Envoy config's shape (Envoy itself is not installable here)."""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.native.launch import PROXY_SERVER_ARGS

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
NGINX = DEPLOY / "nginx" / "llama-radix.conf"

kv = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e '.[test]')"
)


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def manifests() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name != "kustomization.yaml":
            out += [(f"{path.relative_to(K8S)}:{d['kind']}", d) for d in docs(path)]
    return out


def validate(doc: dict[str, Any]) -> None:
    kv.validate(doc, kv.latest_version(), strict=True)


def by_kind(kind: str, name: str) -> dict[str, Any]:
    return next(d for _, d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name)


CORE = [(n, d) for n, d in manifests() if not d["apiVersion"].startswith("monitoring.coreos.com")]


@pytest.mark.parametrize(("name", "doc"), CORE, ids=[n for n, _ in CORE])
def test_manifest_passes_the_schema(name: str, doc: dict[str, Any]) -> None:
    validate(doc)


def statefulset() -> dict[str, Any]:
    return by_kind("StatefulSet", "llama-radix")


def _set(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    node: Any = out
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[int(k)] if k.isdigit() else node[k]
    node[keys[-1]] = value
    return out


BROKEN = [
    ("port is a word", "spec.template.spec.containers.1.ports.0.containerPort", "eighty"),
    ("unknown field (strict)", "spec.template.spec.containers.0.imagePullPolcy", "Always"),
    ("replicas not a number", "spec.replicas", "two"),
    ("probe without a handler field type", "spec.template.spec.containers.1.readinessProbe.httpGet", "nope"),
]


@pytest.mark.parametrize(("what", "path", "value"), BROKEN, ids=[b[0] for b in BROKEN])
def test_an_invalid_manifest_fails(what: str, path: str, value: Any) -> None:
    with pytest.raises(kv.ValidationError):
        validate(_set(statefulset(), path, value))


def test_kustomization_lists_existing_files_and_every_core_manifest() -> None:
    listed = set(docs(K8S / "kustomization.yaml")[0]["resources"])
    assert all((K8S / r).is_file() for r in listed)
    unlisted = {p.name for p in K8S.glob("*.yaml")} - listed - {"kustomization.yaml"}
    assert unlisted == {"secret.example.yaml"}  # the keys are created by hand, never shipped


def test_server_and_proxy_share_a_memory_volume_for_payloads() -> None:
    pod = statefulset()["spec"]["template"]["spec"]
    shm = next(v for v in pod["volumes"] if v["name"] == "kv-shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    server, proxy = (next(c for c in pod["containers"] if c["name"] == n) for n in ("llama-server", "proxy"))
    mount = {
        c["name"]: next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "kv-shm")
        for c in (server, proxy)
    }
    assert mount["llama-server"] == mount["proxy"]
    args = server["args"]
    assert args[args.index("--kvctl-dir") + 1] == mount["proxy"]
    env = {e["name"]: e for e in proxy["env"]}
    assert env["RADIX_SHM_DIR"]["value"] == mount["proxy"]
    # The server's flags are the ones the proxy needs (proxy/native/launch.py).
    joined = " ".join(args)
    assert " ".join(PROXY_SERVER_ARGS) in joined and "--kvctl" in args
    assert args[args.index("--host") + 1] == "127.0.0.1"  # only the proxy reaches the slots
    assert env["RADIX_BACKENDS"]["value"] == f"http://127.0.0.1:{args[args.index('--port') + 1]}"


def test_keys_come_from_a_secret() -> None:
    pod = statefulset()["spec"]["template"]["spec"]
    proxy = next(c for c in pod["containers"] if c["name"] == "proxy")
    env = {e["name"]: e for e in proxy["env"]}
    assert env["RADIX_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "llama-radix-keys"
    key_vol = next(v for v in pod["volumes"] if v["name"] == "kvctl-key")
    assert key_vol["secret"]["secretName"] == "llama-radix-keys"
    # The /kvctl key reaches both containers as the same Secret file, never in argv or env.
    server = next(c for c in pod["containers"] if c["name"] == "llama-server")
    mount = next(m["mountPath"] for m in server["volumeMounts"] if m["name"] == "kvctl-key")
    assert server["args"][server["args"].index("--kvctl-key-file") + 1] == f"{mount}/kvctl-key"
    proxy_mount = next(m["mountPath"] for m in proxy["volumeMounts"] if m["name"] == "kvctl-key")
    assert env["RADIX_KVCTL_KEY_FILE"]["value"] == f"{proxy_mount}/kvctl-key"
    assert "RADIX_KVCTL_KEY" not in env
    secret = by_kind("Secret", "llama-radix-keys")
    assert set(secret["stringData"]) == {"kvctl-key", "admin-key"}


WORKLOADS = [("StatefulSet", "llama-radix"), ("Deployment", "llama-radix-balancer")]


@pytest.mark.parametrize(("kind", "name"), WORKLOADS)
def test_non_root_and_probed(kind: str, name: str) -> None:
    pod = by_kind(kind, name)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
        assert "livenessProbe" in c and ("readinessProbe" in c or "startupProbe" in c), c["name"]


def test_probes_hit_the_real_endpoints() -> None:
    pod = statefulset()["spec"]["template"]["spec"]
    server, proxy = pod["containers"]
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    port = server["args"][server["args"].index("--port") + 1]
    for probe in ("startupProbe", "livenessProbe"):
        assert f"http://127.0.0.1:{port}/health" in " ".join(server[probe]["exec"]["command"])


def test_metrics_are_scraped() -> None:
    template = statefulset()["spec"]["template"]
    ann = template["metadata"]["annotations"]
    # The metrics port (/metrics only, no key): on the client port /metrics needs the admin key.
    port = next(p for p in template["spec"]["containers"][1]["ports"] if p["name"] == "metrics")[
        "containerPort"
    ]
    env = {e["name"]: e.get("value") for e in template["spec"]["containers"][1]["env"]}
    assert env["RADIX_METRICS_PORT"] == str(port)
    assert (ann["prometheus.io/scrape"], ann["prometheus.io/path"], ann["prometheus.io/port"]) == (
        "true",
        "/metrics",
        str(port),
    )
    monitor = by_kind("ServiceMonitor", "llama-radix")
    service = by_kind("Service", "llama-radix")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()


def test_balancer_config_is_the_shipped_nginx_file_with_the_pods_as_upstreams() -> None:
    cm = by_kind("ConfigMap", "llama-radix-balancer")["data"]["llama-radix.conf"]
    replicas = statefulset()["spec"]["replicas"]
    ups = "".join(
        f"    server llama-radix-{i}.llama-radix:8080 max_fails=3 fail_timeout=10s;\n"
        for i in range(replicas)
    )
    want, n_up = re.subn(r"(?:    server 127\.0\.0\.1:\d+ [^\n]*\n)+", ups, NGINX.read_text())
    want, n_listen = re.subn(r"listen 127\.0\.0\.1:\d+;", "listen 8080;", want)
    assert (n_up, n_listen) == (1, 1)
    assert cm == want
    deployment = by_kind("Deployment", "llama-radix-balancer")["spec"]["template"]["spec"]
    assert deployment["volumes"][0]["configMap"]["name"] == "llama-radix-balancer"
    assert "hash $radix_key consistent;" in cm


def test_envoy_hashes_the_same_key_on_a_ring() -> None:
    conf = docs(DEPLOY / "envoy" / "envoy.yaml")[0]["static_resources"]
    cluster = conf["clusters"][0]
    assert cluster["lb_policy"] == "RING_HASH"
    hcm = conf["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    main = next(r for r in routes if r["match"] == {"prefix": "/"})
    assert main["route"]["cluster"] == cluster["name"]
    policies = main["route"]["hash_policy"]
    assert [p.get("header", {}).get("header_name") for p in policies] == [
        "x-session-id",
        "authorization",
        None,
    ]
    assert all(p.get("terminal") for p in policies[:-1])
    blocked = {r["match"].get("prefix") or r["match"].get("path") for r in routes if "direct_response" in r}
    assert blocked == {"/radix/", "/metrics"}
    # Matched on the normalized path, or /%72adix/routes would pass the block.
    assert hcm["normalize_path"] is True and hcm["merge_slashes"] is True
    assert hcm["path_with_escaped_slashes_action"] == "REJECT_REQUEST"


def test_every_shell_script_with_a_shebang_is_executable_in_git() -> None:
    """Docs run them as `deploy/gpu/carry.sh`: a script committed 100644 fails on a clean clone.
    Scripts without a shebang are sourced (deploy/docker/ca-env.sh) and stay 100644."""
    root = Path(__file__).resolve().parents[2]
    staged = subprocess.run(
        ["git", "ls-files", "-s", "--", "*.sh"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    modes = {line.split("\t")[1]: line.split()[0] for line in staged}
    modes = {path: mode for path, mode in modes.items() if (root / path).read_bytes().startswith(b"#!")}
    assert modes, "no shell scripts found by git"
    assert {path: mode for path, mode in modes.items() if mode != "100755"} == {}
