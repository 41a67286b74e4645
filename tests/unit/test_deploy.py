"""Deployment files: Kubernetes manifests against the API schema (kubernetes-validate, strict),
plus what the schema cannot say (shared memory, keys, probes, scraping, the balancer's config,
the Valkey component and the proxies it points at the store); the Envoy config's shape (Envoy
itself is not installable here)."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.native.launch import PROXY_SERVER_ARGS

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
VALKEY = K8S / "valkey"
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
    # remote-key and valkey-password: read only with the valkey component.
    assert set(secret["stringData"]) == {"kvctl-key", "admin-key", "remote-key", "valkey-password"}


WORKLOADS = [
    ("StatefulSet", "llama-radix"),
    ("Deployment", "llama-radix-balancer"),
    ("StatefulSet", "llama-radix-valkey"),
]


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


# ---- the Valkey component (deploy/k8s/valkey: the remote tier's store, docs/scale-out.md) ---------


def component() -> dict[str, Any]:
    return docs(VALKEY / "kustomization.yaml")[0]


def test_the_valkey_component_is_opt_in_and_lists_its_files() -> None:
    comp = component()
    assert comp["kind"] == "Component"
    assert set(comp["resources"]) == {p.name for p in VALKEY.glob("*.yaml")} - {"kustomization.yaml"}
    base = (K8S / "kustomization.yaml").read_text()
    assert "components" not in docs(K8S / "kustomization.yaml")[0]  # the base runs without a store
    assert "#components:\n#  - valkey\n" in base  # how to turn it on, said where it is turned on


def valkey_pod() -> dict[str, Any]:
    sts = by_kind("StatefulSet", "llama-radix-valkey")
    # One store: more replicas would be separate stores, not a cluster. A cache: no claim.
    assert sts["spec"]["replicas"] == 1 and "volumeClaimTemplates" not in sts["spec"]
    pod: dict[str, Any] = sts["spec"]["template"]["spec"]
    return pod


def test_the_store_takes_its_password_from_the_secret_as_a_file() -> None:
    pod = valkey_pod()
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    vol = next(v for v in pod["volumes"] if v["name"] == "password")
    assert vol["secret"]["secretName"] == "llama-radix-keys"
    assert vol["secret"]["items"] == [{"key": "valkey-password", "path": "valkey-password"}]
    # A Secret file is root's and the pod's fsGroup's: the group must be able to read it.
    assert vol["secret"]["defaultMode"] == 0o440 and pod["securityContext"]["fsGroup"] == 10001
    mount = next(m for m in container["volumeMounts"] if m["name"] == "password")
    assert mount["readOnly"] is True
    assert env["RADIX_VALKEY_PASSWORD_FILE"]["value"] == f"{mount['mountPath']}/valkey-password"
    # Never in the environment or argv: no secretKeyRef, no command (the image's entrypoint).
    assert not any("valueFrom" in e for e in container["env"])
    assert "command" not in container and "args" not in container
    run = next(v for v in pod["volumes"] if v["name"] == "run")
    assert run["emptyDir"]["medium"] == "Memory"  # the config file with the password
    run_mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "run")
    assert env["RADIX_VALKEY_RUN_DIR"]["value"] == run_mount
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"] == ["/usr/local/bin/radix-valkey-ping"]
    assert "limits" in container["resources"] and env["RADIX_VALKEY_MAXMEMORY"]["value"].endswith("gb")


def test_the_store_is_reached_by_the_proxies_only() -> None:
    sts = by_kind("StatefulSet", "llama-radix-valkey")
    labels = sts["spec"]["template"]["metadata"]["labels"]
    service = by_kind("Service", "llama-radix-valkey")
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"].items() <= labels.items()
    port = sts["spec"]["template"]["spec"]["containers"][0]["ports"][0]
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    # The proxies' Service and the store's select disjoint pods.
    proxies = statefulset()["spec"]["template"]["metadata"]["labels"]
    assert not by_kind("Service", "llama-radix")["spec"]["selector"].items() <= labels.items()
    assert not service["spec"]["selector"].items() <= proxies.items()
    policy = by_kind("NetworkPolicy", "llama-radix-valkey")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    assert source["podSelector"]["matchLabels"].items() <= proxies.items()
    assert rule["ports"] == [{"port": port["containerPort"], "protocol": "TCP"}]


def json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902's `add` and `test`, the ops the component uses (kustomize applies them)."""
    out = copy.deepcopy(doc)
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node: Any = out
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if op["op"] == "test":
            assert (node[int(last)] if isinstance(node, list) else node[last]) == op["value"], op
        elif op["op"] == "add" and isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), op["value"])
        elif op["op"] == "add":
            node[last] = op["value"]
        else:
            raise AssertionError(f"an op this test does not apply: {op}")
    return out


def with_component() -> dict[str, Any]:
    (patch,) = component()["patches"]
    assert patch["target"] == {"group": "apps", "version": "v1", "kind": "StatefulSet", "name": "llama-radix"}
    return json_patch(statefulset(), yaml.safe_load(patch["patch"]))


def check_proxy_on_the_store(sts: dict[str, Any]) -> None:
    validate(sts)
    pod = sts["spec"]["template"]["spec"]
    proxy = next(c for c in pod["containers"] if c["name"] == "proxy")
    env = {e["name"]: e["value"] for e in proxy["env"] if "value" in e}
    store = by_kind("StatefulSet", "llama-radix-valkey")
    port = store["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    name = store["metadata"]["name"]
    assert env["RADIX_CACHE_REMOTE"] == f"valkey://{name}-0.{store['spec']['serviceName']}:{port}/0"
    # The key and password: copied by the init container from the Secret into a memory
    # emptyDir as the proxy's user, mode 0400 (the proxy refuses a root-owned or group-readable
    # file, which is what a Secret volume holds).
    (init,) = pod["initContainers"]
    secret = next(v for v in pod["volumes"] if v["name"] == "remote-secret")["secret"]
    assert secret["secretName"] == "llama-radix-keys"
    assert {i["key"] for i in secret["items"]} == {"remote-key", "valkey-password"}
    keys = next(v for v in pod["volumes"] if v["name"] == "remote-keys")
    assert keys["emptyDir"]["medium"] == "Memory"
    copied = next(m["mountPath"] for m in init["volumeMounts"] if m["name"] == "remote-keys")
    src = next(m["mountPath"] for m in init["volumeMounts"] if m["name"] == "remote-secret")
    assert init["command"] == [
        "install",
        "-m",
        "0400",
        f"{src}/remote-key",
        f"{src}/valkey-password",
        f"{copied}/",
    ]
    assert init["image"] == proxy["image"] and init["securityContext"]["capabilities"]["drop"] == ["ALL"]
    mount = next(m for m in proxy["volumeMounts"] if m["name"] == "remote-keys")
    assert mount["readOnly"] is True
    assert env["RADIX_CACHE_REMOTE_KEY_FILE"] == f"{mount['mountPath']}/remote-key"
    assert env["RADIX_CACHE_REMOTE_PASSWORD_FILE"] == f"{mount['mountPath']}/valkey-password"
    assert pod["securityContext"]["runAsUser"] == 10001  # the init container's user is the proxy's


def test_the_component_points_every_proxy_at_the_store() -> None:
    check_proxy_on_the_store(with_component())


def test_the_component_fails_where_the_proxy_container_moved() -> None:
    sts = statefulset()
    sts["spec"]["template"]["spec"]["containers"].reverse()
    (patch,) = component()["patches"]
    with pytest.raises(AssertionError):
        json_patch(sts, yaml.safe_load(patch["patch"]))


@pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl is not installed (its kustomize builds it)"
)
def test_kustomize_builds_the_base_with_the_component(tmp_path: Path) -> None:
    """As an operator turns it on: the commented `components` lines of the base uncommented."""
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    base = tree / "kustomization.yaml"
    base.write_text(base.read_text().replace("#components:\n#  - valkey\n", "components:\n  - valkey\n"))
    built = subprocess.run(["kubectl", "kustomize", str(tree)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    out = [d for d in yaml.safe_load_all(built.stdout) if d]
    for doc in out:
        validate(doc)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in out}
    assert {("StatefulSet", "llama-radix-valkey"), ("Service", "llama-radix-valkey")} <= kinds
    assert ("NetworkPolicy", "llama-radix-valkey") in kinds
    sts = next(d for d in out if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "llama-radix")
    check_proxy_on_the_store(sts)
    assert sts == with_component()  # kustomize and this test's patch agree
