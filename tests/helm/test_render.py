"""The Tandem chart renders (Helm's Go engine, offline), lints clean, and every object is valid Kubernetes."""

from __future__ import annotations

import glob
import json
import os

import pytest

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's engine) is not installed")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

import yaml  # noqa: E402

from tests.helm.chart import (CASES, CHART_DIR, KUBE_VERSION, NAMESPACE, RELEASE, find, notes, objects, one,  # noqa: E402
                              render)

# Custom resources: kubernetes-validate only knows built-in kinds, so these are checked by hand below.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule"),
             ("keda.sh/v1alpha1", "ScaledObject")}


@pytest.mark.parametrize("case", CASES)
def test_helm_lint_is_clean(case):
    report = helm_python.lint(CHART_DIR, CASES[case], strict=True, namespace=NAMESPACE,
                              kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warning or error
    assert not report["errors"] and not problems, (report["errors"], problems)


@pytest.mark.parametrize("case", CASES)
def test_every_object_validates_against_kubernetes_schemas(case):
    rendered = objects(case)
    assert rendered
    for obj in rendered:
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            continue
        # strict: unknown fields are errors too (a typo in a template would otherwise pass).
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        assert obj["metadata"]["namespace"] == NAMESPACE


def test_default_renders_disaggregated_topology():
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objects("default"))
    assert kinds == sorted([
        ("Secret", f"{RELEASE}-tandem-tls"),
        ("NetworkPolicy", f"{RELEASE}-tandem-prefill"), ("NetworkPolicy", f"{RELEASE}-tandem-decode"),
        ("ConfigMap", f"{RELEASE}-tandem-dashboards"),
        ("Deployment", f"{RELEASE}-tandem-router"), ("Service", f"{RELEASE}-tandem-router"),
        ("PodDisruptionBudget", f"{RELEASE}-tandem-router"),
        ("Deployment", f"{RELEASE}-tandem-prefill"), ("Service", f"{RELEASE}-tandem-prefill"),
        ("PodDisruptionBudget", f"{RELEASE}-tandem-prefill"),
        ("Deployment", f"{RELEASE}-tandem-decode"), ("Service", f"{RELEASE}-tandem-decode"),
        ("PodDisruptionBudget", f"{RELEASE}-tandem-decode"),
        ("ServiceAccount", f"{RELEASE}-tandem"),
        ("Pod", f"{RELEASE}-tandem-test-chat"),  # the `helm test` hook
    ])


def test_unified_mode_runs_workers_instead_of_prefill_and_decode():
    components = {o["metadata"]["labels"]["app.kubernetes.io/component"] for o in find("unified-cpu", "Deployment")}
    assert components == {"router", "worker"}
    worker = one("unified-cpu", "Deployment", "worker")
    assert worker["spec"]["replicas"] == 3
    container = worker["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in json.dumps(container.get("resources", {}))
    assert all(v["name"] != "model" for v in worker["spec"]["template"]["spec"]["volumes"])  # baked into the image


@pytest.mark.parametrize("case", CASES)
def test_worker_services_are_headless_and_expose_the_ports(case):
    for service in find(case, "Service"):
        component = service["metadata"]["labels"]["app.kubernetes.io/component"]
        ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
        if component in ("router", "planner"):
            assert service["spec"].get("clusterIP") != "None" and "http" in ports
            continue
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["publishNotReadyAddresses"] is False  # draining pods leave DNS
        assert "grpc" in ports
        assert ("bootstrap" in ports) == (component == "prefill")


@pytest.mark.parametrize("case", CASES)
def test_workers_use_grpc_probes_and_outlive_their_drain(case):
    for deployment in find(case, "Deployment"):
        if deployment["metadata"]["labels"]["app.kubernetes.io/component"] in ("router", "planner"):
            continue
        spec = deployment["spec"]["template"]["spec"]
        container = spec["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        # Under mutual TLS the kubelet (no certificate) probes the plaintext health-only port.
        port = ports.get("health", ports["grpc"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == port
        args = container["args"]
        drain = float(args[args.index("--drain-timeout") + 1])
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        assert spec["terminationGracePeriodSeconds"] > drain + pre_stop


@pytest.mark.parametrize("case", CASES)
def test_security_contexts_are_restricted(case):
    for deployment in find(case, "Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["automountServiceAccountToken"] is False
        for container in spec["containers"] + spec.get("initContainers", []):
            context = container["securityContext"]
            assert context["capabilities"]["drop"] == ["ALL"]
            assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert {"/tmp", "/cache"} <= mounts  # writable scratch behind the read-only root


def test_gpu_rdma_pvc_case_wires_devices_transport_and_model():
    for component in ("prefill", "decode"):
        spec = one("gpu-rdma-pvc", "Deployment", component)["spec"]["template"]["spec"]
        container = spec["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["resources"]["limits"]["rdma/hca"] == 1
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["UCX_TLS"] == "rc,cuda_copy,cuda_ipc" and env["UCX_NET_DEVICES"] == "mlx5_0:1"
        assert env["UCX_LOG_LEVEL"] == "warn"
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "llama-70b", "readOnly": True}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
        assert spec["imagePullSecrets"] == [{"name": "regcred"}]
        assert container["image"] == "registry.example.com/tandem:1.2.3"
    prefill = one("gpu-rdma-pvc", "Deployment", "prefill")["spec"]["template"]["spec"]
    assert prefill["containers"][0]["resources"]["limits"]["memory"] == "400Gi"  # user limits kept
    assert prefill["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    decode = one("gpu-rdma-pvc", "Deployment", "decode")
    assert decode["spec"]["replicas"] == 4 and decode["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 180
    router = one("gpu-rdma-pvc", "Deployment", "router")["spec"]["template"]["spec"]
    assert "rdma/hca" not in json.dumps(router) and "IPC_LOCK" not in json.dumps(router)


def test_init_container_fills_an_empty_dir_the_worker_reads():
    for component in ("prefill", "decode"):
        spec = one("init-container-model", "Deployment", component)["spec"]["template"]["spec"]
        (init,) = spec["initContainers"]
        assert init["image"] == "python:3.11-slim"
        assert {"name": "MODEL_DIR", "value": "/models"} in init["env"]
        assert any(m["name"] == "model" and m["mountPath"] == "/models" for m in init["volumeMounts"])
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["model"]["emptyDir"] == {"sizeLimit": "40Gi"}
        container = spec["containers"][0]
        args = container["args"]
        assert args[args.index("--model") + 1] == "/models/Qwen2.5-7B-Instruct"
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"
        assert env["OTEL_SERVICE_NAME"] == f"tandem-{component}"
        assert env["OTEL_RESOURCE_ATTRIBUTES"].endswith(",deployment.environment=prod")
    router = one("init-container-model", "Deployment", "router")["spec"]["template"]["spec"]["containers"][0]
    key = next(e for e in router["env"] if e["name"] == "TANDEM_ROUTER_API_KEY")
    assert key["valueFrom"]["secretKeyRef"] == {"name": "tandem-api-key", "key": "api-key"}
    assert "--api-key" not in router["args"]  # never on the command line


def test_observability_ingress_and_hpa():
    (monitor,) = find("observability-ingress-hpa", "ServiceMonitor")
    # Structure checked by hand: kubernetes-validate has no schema for this CRD.
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE
    assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [("http", "/metrics")]
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout"}
    router_service = one("observability-ingress-hpa", "Service", "router")
    assert "http" in {p["name"] for p in router_service["spec"]["ports"]}

    (ingress,) = find("observability-ingress-hpa", "Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": f"{RELEASE}-tandem-router", "port": {"name": "http"}}
    assert ingress["spec"]["ingressClassName"] == "nginx"

    (hpa,) = find("observability-ingress-hpa", "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == f"{RELEASE}-tandem-router"
    assert {m["resource"]["name"] for m in hpa["spec"]["metrics"]} == {"cpu", "memory"}
    router = one("observability-ingress-hpa", "Deployment", "router")
    assert "replicas" not in router["spec"]  # the HPA owns it
    pod = router["spec"]["template"]["metadata"]
    assert pod["labels"]["team"] == "inference" and pod["annotations"]["example.com/owner"] == "inference"


def test_worker_metrics_port_is_exposed_and_scraped():
    (monitor,) = find("worker-metrics", "ServiceMonitor")
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["http", "metrics"]
    for component in ("prefill", "decode"):
        ports = {p["name"]: p["port"] for p in one("worker-metrics", "Service", component)["spec"]["ports"]}
        assert ports["metrics"] == 9100


def test_dashboard_configmap_carries_every_dashboard_file():
    (config_map,) = find("default", "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(CHART_DIR, "dashboards", "*")))
    assert files and sorted(config_map["data"]) == files
    for name in files:
        if name.endswith(".json"):
            dashboard = json.loads(config_map["data"][name])
            assert dashboard["title"] and "TODO" not in dashboard["title"]


def test_notes_tell_how_to_reach_the_router():
    text = notes("default")
    assert f"svc/{RELEASE}-tandem-router 8000:8000" in text
    assert f"{RELEASE}-tandem-prefill.{NAMESPACE}.svc.cluster.local:30000, bootstrap 8998" in text
    assert "https://llm.example.com/v1/models" in notes("observability-ingress-hpa")


TLS_FLAGS = {"--tls-ca-file": "/etc/tandem/tls/ca.crt", "--tls-cert-file": "/etc/tandem/tls/tls.crt",
             "--tls-key-file": "/etc/tandem/tls/tls.key"}


def _flag(argv: list[str], name: str):
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.mark.parametrize("case", ["default", "tls-existing-secret", "unified-tls"])
def test_tls_secret_is_mounted_in_every_pod_and_its_files_passed_as_flags(case):
    secret = "tandem-mtls" if case == "tls-existing-secret" else f"{RELEASE}-tandem-tls"
    server_name = "tandem.llm.svc" if case == "tls-existing-secret" else "tandem-internal"
    deployments = find(case, "Deployment")
    assert {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in deployments} >= {"router"}
    for deployment in deployments:
        spec = deployment["spec"]["template"]["spec"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "tls"]
        assert volume["secret"]["secretName"] == secret and volume["secret"]["defaultMode"] == 0o440
        container = spec["containers"][0]
        assert {"name": "tls", "mountPath": "/etc/tandem/tls", "readOnly": True} in container["volumeMounts"]
        args = container["args"]
        assert {flag: _flag(args, flag) for flag in TLS_FLAGS} == TLS_FLAGS
        assert _flag(args, "--tls-server-name") == server_name
        if deployment["metadata"]["labels"]["app.kubernetes.io/component"] != "router":
            health = next(p["containerPort"] for p in container["ports"] if p["name"] == "health")
            assert _flag(args, "--health-port") == str(health)
    generated = find(case, "Secret")
    if case == "tls-existing-secret":
        assert generated == []  # the user's Secret is used as it is
    else:
        (generated,) = generated
        assert sorted(generated["data"]) == ["ca.crt", "tls.crt", "tls.key"]


def test_generated_certificate_is_signed_by_the_ca_for_the_server_name():
    import base64

    from cryptography import x509

    (secret,) = find("default", "Secret")
    ca = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["ca.crt"]))
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["tandem-internal"]
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {u.dotted_string for u in usages} >= {"1.3.6.1.5.5.7.3.1", "1.3.6.1.5.5.7.3.2"}  # server and client


def test_security_off_renders_plaintext_without_policies():
    assert find("security-off", "Secret") == [] and find("security-off", "NetworkPolicy") == []
    for deployment in find("security-off", "Deployment"):
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert not any(a.startswith("--tls-") for a in container["args"]) and "--health-port" not in container["args"]
        component = deployment["metadata"]["labels"]["app.kubernetes.io/component"]
        assert ("--insecure" in container["args"]) == (component != "router")  # plaintext workers say so


def _selector(component: str) -> dict:
    return {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": RELEASE,
            "app.kubernetes.io/component": component}


def test_network_policies_keep_worker_ports_to_the_router_and_the_pair():
    policies = {p["metadata"]["labels"]["app.kubernetes.io/component"]: p["spec"]
                for p in find("tls-existing-secret", "NetworkPolicy")}
    assert sorted(policies) == ["decode", "prefill"]
    for component, peer in (("prefill", "decode"), ("decode", "prefill")):
        spec = policies[component]
        assert spec["podSelector"]["matchLabels"] == _selector(component) and spec["policyTypes"] == ["Ingress"]
        from_router, from_peer, open_ports = spec["ingress"]
        assert from_router["from"] == [{"podSelector": {"matchLabels": _selector("router")}}]
        assert from_router["ports"] == [{"port": 30000, "protocol": "TCP"}]  # gRPC only: not the bootstrap port
        # Only the pair's other side reaches every port: the prefill's bootstrap port, NIXL's UCX connections.
        assert from_peer == {"from": [{"podSelector": {"matchLabels": _selector(peer)}}]}
        assert "from" not in open_ports and open_ports["ports"] == [{"port": 9555, "protocol": "TCP"},
                                                                   {"port": 9090, "protocol": "TCP"}]
    (unified,) = find("unified-tls", "NetworkPolicy")
    assert len(unified["spec"]["ingress"]) == 2  # the router, and the health port


def test_default_ingress_path_keeps_metrics_and_readiness_private():
    values = render({"ingress": {"enabled": True}})
    (ingress,) = [doc for path, text in values.items() if path.endswith("ingress.yaml")
                  for doc in yaml.safe_load_all(text) if doc]
    paths = [p["path"] for rule in ingress["spec"]["rules"] for p in rule["http"]["paths"]]
    assert paths == ["/v1"]  # /metrics, /readiness, /health, /workers are not under it


def test_tensor_parallel_worker_gets_tp_size_and_one_gpu_per_rank():
    container = one("unified-tp2", "Deployment", "worker")["spec"]["template"]["spec"]["containers"][0]
    assert _flag(container["args"], "--tp-size") == "2"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    default = one("default", "Deployment", "decode")["spec"]["template"]["spec"]["containers"][0]
    assert not {"--tp-size", "--pp-size", "--dp-size"} & set(default["args"])


def test_parallel_values_render_their_flags_and_dp_x_tp_x_pp_gpus():
    """tp/pp/dp per role: each renders its flag when > 1; a pod asks for one GPU per rank of every replica."""
    container = one("unified-tp2-dp2", "Deployment", "worker")["spec"]["template"]["spec"]["containers"][0]
    assert (_flag(container["args"], "--tp-size"), _flag(container["args"], "--dp-size")) == ("2", "2")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    for role, dp in (("prefill", "2"), ("decode", "4")):
        container = one("pd-dp2", "Deployment", role)["spec"]["template"]["spec"]["containers"][0]
        assert _flag(container["args"], "--dp-size") == dp and "--tp-size" not in container["args"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == int(dp)
    # Prefill and decode replicas at TP > 1: dp x tp GPUs per pod.
    prefill = one("pd-dp2xtp2", "Deployment", "prefill")["spec"]["template"]["spec"]["containers"][0]
    assert (_flag(prefill["args"], "--tp-size"), _flag(prefill["args"], "--dp-size")) == ("2", "2")
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == 4
    decode = one("pd-dp2xtp2", "Deployment", "decode")["spec"]["template"]["spec"]["containers"][0]
    assert _flag(decode["args"], "--dp-size") == "2" and "--tp-size" not in decode["args"]
    assert decode["resources"]["limits"]["nvidia.com/gpu"] == 2
    decode = one("pd-tp1-tp2", "Deployment", "decode")["spec"]["template"]["spec"]["containers"][0]
    prefill = one("pd-tp1-tp2", "Deployment", "prefill")["spec"]["template"]["spec"]["containers"][0]
    assert _flag(decode["args"], "--tp-size") == "2" and "--tp-size" not in prefill["args"]  # PD at different TP
    assert decode["resources"]["limits"]["nvidia.com/gpu"] == 2
    rendered = render({"mode": "unified", "worker": {"tp": 2, "pp": 2, "gpus": 4}})
    (deployment,) = [doc for path, text in rendered.items() if path.endswith("worker.yaml")
                     for doc in yaml.safe_load_all(text) if doc and doc["kind"] == "Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert (_flag(args, "--tp-size"), _flag(args, "--pp-size")) == ("2", "2")  # one worker of tp x pp ranks
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4


def test_expert_parallel_renders_ep_size_and_no_extra_gpus():
    """ep per role renders --ep-size when > 1; the EP ranks are the TP ranks, so a pod's GPUs stay dp x tp x pp."""
    for role, tp in (("prefill", "2"), ("decode", "4")):
        container = one("pd-moe-ep", "Deployment", role)["spec"]["template"]["spec"]["containers"][0]
        assert (_flag(container["args"], "--tp-size"), _flag(container["args"], "--ep-size")) == (tp, "2")
        assert container["resources"]["limits"]["nvidia.com/gpu"] == int(tp)
    default = one("default", "Deployment", "prefill")["spec"]["template"]["spec"]["containers"][0]
    assert "--ep-size" not in default["args"]


def test_the_planner_drives_an_hpa_per_pool_from_its_plan():
    planner = one("planner-hpa", "Deployment", "planner")
    argv = planner["spec"]["template"]["spec"]["containers"][0]["args"]
    flags = dict(zip(argv[3::2], argv[4::2]))  # after --log-level LEVEL planner
    assert argv[2] == "planner" and flags["--router-url"] == f"http://{RELEASE}-tandem-router:8000"
    assert (flags["--ttft-slo-ms"], flags["--itl-slo-ms"], flags["--min-decode"], flags["--max-decode"]) == \
        ("500", "40", "2", "6")
    service = one("planner-hpa", "Service", "planner")
    assert [p["name"] for p in service["spec"]["ports"]] == ["http"]  # the ServiceMonitor's port name
    for role, bounds in (("prefill", (1, 3)), ("decode", (2, 6))):
        hpa = one("planner-hpa", "HorizontalPodAutoscaler", role)
        assert hpa["spec"]["scaleTargetRef"]["name"] == f"{RELEASE}-tandem-{role}"
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == bounds
        (metric,) = hpa["spec"]["metrics"]
        assert metric["external"]["metric"] == {"name": "tandem_planner_desired_replicas",
                                                "selector": {"matchLabels": {"role": role, "namespace": "llm"}}}
        assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
        assert "replicas" not in one("planner-hpa", "Deployment", role)["spec"]  # the HPA owns it
    assert not find("default", "HorizontalPodAutoscaler") and not find("default", "Deployment", "planner")


def test_the_planner_drives_keda_scaled_objects():
    for role in ("prefill", "decode"):
        (scaled,) = [o for o in find("planner-keda", "ScaledObject")
                     if o["metadata"]["labels"]["app.kubernetes.io/component"] == role]
        # Structure checked by hand: kubernetes-validate has no schema for KEDA's CRD.
        assert scaled["apiVersion"] == "keda.sh/v1alpha1"
        assert scaled["spec"]["scaleTargetRef"] == {"name": f"{RELEASE}-tandem-{role}"}
        (trigger,) = scaled["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "1"
        assert trigger["metadata"]["query"] == \
            f'max(tandem_planner_desired_replicas{{role="{role}", namespace="{NAMESPACE}"}})'
        assert set(scaled["spec"]) == {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval",
                                       "cooldownPeriod", "triggers"}
    assert not find("planner-keda", "HorizontalPodAutoscaler")


@pytest.mark.parametrize("values, message", [
    ({"mode": "unified", "planner": {"enabled": True}}, "needs mode disaggregated"),
    ({"planner": {"enabled": True, "prefill": {"minReplicas": 3, "maxReplicas": 2}}}, "planner.prefill.minReplicas"),
])
def test_the_planner_refuses_what_it_cannot_plan(values, message):
    with pytest.raises(Exception, match=message):
        render(values)
