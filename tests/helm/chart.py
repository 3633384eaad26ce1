"""Helpers for the chart tests: the value sets we render, offline rendering through Helm's own Go engine
(helm-python-sdk), and access to the rendered objects and containers."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator, Optional

import yaml

CHART_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "helm", "tandem")
RELEASE = "demo"
NAMESPACE = "llm"
KUBE_VERSION = "1.35.0"  # schemas of kubernetes-validate; the chart needs >= 1.30

# Representative value sets. Each key is a test id.
CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "unified-cpu": {
        "mode": "unified",
        "model": {"source": "image", "path": "/opt/models/tiny-llama", "servedModelName": "tiny"},
        "engine": {"dtype": "float32", "numThreads": 8, "eventLoop": "normal"},
        "worker": {"replicas": 3, "gpus": 0, "resources": {"requests": {"cpu": "8", "memory": "16Gi"}},
                   "engine": {"maxTotalTokens": 65536}},
        "router": {"policy": "round_robin", "grpc": {"enabled": False}, "mountModel": True},
        "sharedMemory": {"enabled": False},
    },
    "unified-tp2": {
        "mode": "unified",
        "model": {"source": "image", "path": "/opt/models/llama"},
        "worker": {"replicas": 2, "tp": 2, "gpus": 2},
    },
    "unified-tp2-dp2": {
        "mode": "unified",
        "model": {"source": "image", "path": "/opt/models/llama"},
        "worker": {"tp": 2, "dp": 2, "gpus": 4},
    },
    "pd-dp2": {
        "model": {"source": "image", "path": "/opt/models/llama"},
        "prefill": {"dp": 2, "gpus": 2},
        "decode": {"dp": 4, "gpus": 4},
        "router": {"prefillPolicy": "cache_aware"},
    },
    "pd-dp2xtp2": {
        "model": {"source": "image", "path": "/opt/models/llama"},
        "prefill": {"dp": 2, "tp": 2, "gpus": 4},
        "decode": {"dp": 2, "tp": 1, "gpus": 2},
    },
    "pd-tp1-tp2": {
        "model": {"source": "image", "path": "/opt/models/llama"},
        "prefill": {"tp": 1, "gpus": 1},
        "decode": {"tp": 2, "gpus": 2},
    },
    # An MoE model's experts split over the ranks: prefill 2 ways over its 2 ranks, decode 2 ways over its 4.
    "pd-moe-ep": {
        "model": {"source": "image", "path": "/opt/models/qwen3-moe"},
        "prefill": {"tp": 2, "ep": 2, "gpus": 2},
        "decode": {"tp": 4, "ep": 2, "gpus": 4},
    },
    "gpu-rdma-pvc": {
        "image": {"repository": "registry.example.com/tandem", "tag": "1.2.3", "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "regcred"}],
        "model": {"source": "pvc", "pvc": {"claimName": "llama-70b"}, "path": "Llama-3-70B-Instruct",
                  "servedModelName": "llama-3-70b"},
        "engine": {"dtype": "bfloat16", "memFraction": 0.85, "maxTotalTokens": 1000000, "pageSize": 64,
                   "disableRadixCache": False},
        "transfer": {"bootstrapTimeout": 60, "heartbeatMaxMissed": 5, "transferTimeout": 300.5},
        "nixl": {"ucxTls": "rc,cuda_copy,cuda_ipc", "ucxNetDevices": "mlx5_0:1", "env": {"UCX_LOG_LEVEL": "warn"}},
        "rdma": {"enabled": True, "resourceName": "rdma/hca", "count": 1},
        "sharedMemory": {"sizeLimit": "32Gi"},
        "prefill": {"replicas": 2, "gpus": 1, "engine": {"chunkedPrefillSize": 8192, "schedulePolicy": "lpm"},
                    "nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "resources": {"requests": {"cpu": "16", "memory": "200Gi"}, "limits": {"memory": "400Gi"}},
                    "extraArgs": ["--heartbeat-interval", "2"]},
        "decode": {"replicas": 4, "gpus": 1, "engine": {"maxRunningRequests": 512, "disableRadixCache": True},
                   "drainTimeoutSeconds": 120, "terminationGracePeriodSeconds": 180,
                   "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                       {"weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname", "labelSelector": {
                           "matchLabels": {"app.kubernetes.io/component": "decode"}}}}]}},
                   "extraEnv": [{"name": "NCCL_DEBUG", "value": "WARN"}]},
        "router": {"prefillPolicy": "cache_aware", "decodePolicy": "least_load", "maxRunningRequests": 2048,
                   "requestTimeoutSeconds": 900, "mountModel": True},
    },
    "init-container-model": {
        "model": {"source": "initContainer", "path": "Qwen2.5-7B-Instruct",
                  "initContainer": {"image": {"repository": "python", "tag": "3.11-slim"},
                                    "command": ["sh", "-c"],
                                    "args": ["pip install --user huggingface_hub && python -c \"from huggingface_hub import "
                                             "snapshot_download; snapshot_download('Qwen/Qwen2.5-7B-Instruct', "
                                             "local_dir='$MODEL_DIR/Qwen2.5-7B-Instruct')\""],
                                    "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
                                        "name": "hf", "key": "token"}}}],
                                    "sizeLimit": "40Gi"}},
        "router": {"apiKey": {"existingSecret": "tandem-api-key"}},
        "otel": {"endpoint": "http://otel-collector.observability:4317", "resourceAttributes": "deployment.environment=prod"},
        "logLevel": "debug",
    },
    "observability-ingress-hpa": {
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
        "ingress": {"enabled": True, "className": "nginx",
                    "annotations": {"nginx.ingress.kubernetes.io/proxy-read-timeout": "600"},
                    "hosts": [{"host": "llm.example.com", "paths": [{"path": "/v1", "pathType": "Prefix"}]}],
                    "tls": [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}]},
        "router": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 10,
                                   "targetMemoryUtilizationPercentage": 80}},
        "grafanaDashboard": {"labels": {"grafana_dashboard": "1"}, "annotations": {"grafana_folder": "LLM"}},
        "podLabels": {"team": "inference"},
        "podAnnotations": {"example.com/owner": "inference"},
    },
    "hostpath-cpu-minimal": {
        "fullnameOverride": "tandem-cpu",
        "serviceAccount": {"create": False, "name": "inference"},
        "model": {"source": "hostPath", "hostPath": {"path": "/data/models"}, "path": "tiny-llama"},
        "prefill": {"gpus": 0, "preStopSleepSeconds": 0, "pdb": {"enabled": False}, "port": 31000,
                    "bootstrapPort": 31001},
        "decode": {"gpus": 0, "preStopSleepSeconds": 0, "pdb": {"enabled": False}, "port": 32000},
        "router": {"replicas": 1, "pdb": {"enabled": False}, "port": 8080, "grpc": {"port": 9000}},
        "grafanaDashboard": {"enabled": False},
    },
    "worker-metrics": {
        "metrics": {"enabled": True, "port": 9100, "serviceMonitor": {"enabled": True}},
    },
    # Alerts on, with a scrape-job matcher and tighter thresholds; replicas pinned to zones only, no test hook.
    "alerts": {
        "metrics": {"enabled": True, "serviceMonitor": {"enabled": True}},
        "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"},
                           "extraSelector": 'job=~"demo-tandem-.*"', "ttftP99": {"thresholdSeconds": 2.5, "for": "5m"},
                           "kvUsage": {"threshold": 0.95, "for": "15m"}},
        "topologySpread": {"topologyKeys": ["topology.kubernetes.io/zone"], "whenUnsatisfiable": "DoNotSchedule"},
        "router": {"queueTimeoutSeconds": 20, "maxQueuedRequests": 256},
        "helmTest": {"enabled": False},
    },
    # Certificates from cert-manager (or any PKI) instead of the chart's; the decode pinned to the prefills.
    "tls-existing-secret": {
        "tls": {"existingSecret": "tandem-mtls", "serverName": "tandem.llm.svc", "healthPort": 9555},
        "metrics": {"enabled": True},
        "decode": {"extraArgs": ["--allowed-bootstrap", "demo-tandem-prefill.llm.svc.cluster.local:8998"]},
    },
    "unified-tls": {"mode": "unified", "worker": {"gpus": 0}},
    # The planner's plan drives an HPA per pool (External metric), or KEDA ScaledObjects querying Prometheus.
    "planner-hpa": {
        "planner": {"enabled": True, "ttftSloMs": 500, "itlSloMs": 40, "prefill": {"minReplicas": 1, "maxReplicas": 3},
                    "decode": {"minReplicas": 2, "maxReplicas": 6}, "hpa": {"metricLabels": {"namespace": "llm"}}},
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
    "planner-keda": {"planner": {"enabled": True, "autoscaler": "keda", "intervalSeconds": 5}},
    # What deployments before the security work looked like: plaintext, no policies.
    "security-off": {"tls": {"enabled": False}, "networkPolicy": {"enabled": False}},
}


@lru_cache(maxsize=1)
def chart():
    import helm_python

    return helm_python.Chart.load(CHART_DIR)


def render(values: Optional[dict[str, Any]] = None) -> dict[str, str]:
    """Template path -> rendered text, rendered offline by Helm's engine (schema validation included)."""
    return chart().render(values=values, name=RELEASE, namespace=NAMESPACE, is_install=True)


@lru_cache(maxsize=None)
def _rendered_case(case: str) -> dict[str, str]:
    return render(CASES[case])


def objects(case: str) -> list[dict[str, Any]]:
    """Every Kubernetes object the case renders (NOTES.txt excluded)."""
    found = []
    for path, text in sorted(_rendered_case(case).items()):
        if path.endswith("NOTES.txt"):
            continue
        found += [doc for doc in yaml.safe_load_all(text) if doc]
    return found


def notes(case: str) -> str:
    return next(text for path, text in _rendered_case(case).items() if path.endswith("NOTES.txt"))


def find(case: str, kind: str, component: Optional[str] = None) -> list[dict[str, Any]]:
    return [o for o in objects(case) if o["kind"] == kind
            and (component is None or o["metadata"]["labels"].get("app.kubernetes.io/component") == component)]


def one(case: str, kind: str, component: str) -> dict[str, Any]:
    found = find(case, kind, component)
    assert len(found) == 1, f"{case}: expected one {kind} for {component}, got {len(found)}"
    return found[0]


@dataclass
class RenderedContainer:
    workload: str  # the Deployment's component label
    pod_spec: dict[str, Any]
    container: dict[str, Any]

    @property
    def argv(self) -> list[str]:
        return list(self.container.get("command", [])) + list(self.container.get("args", []))


def tandem_containers(case: str) -> Iterator[RenderedContainer]:
    """Every container of every workload whose command is the `tandem` CLI."""
    for deployment in find(case, "Deployment"):
        component = deployment["metadata"]["labels"]["app.kubernetes.io/component"]
        pod_spec = deployment["spec"]["template"]["spec"]
        for container in pod_spec.get("containers", []):
            if container.get("command", [None])[0] == "tandem":
                yield RenderedContainer(component, pod_spec, container)
