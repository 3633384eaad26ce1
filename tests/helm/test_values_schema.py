"""values.schema.json (and the chart's own checks) reject bad values with a message naming the key."""

from __future__ import annotations

import json
import os

import pytest

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's engine) is not installed")
jsonschema = pytest.importorskip("jsonschema")

from tests.helm.chart import CASES, CHART_DIR, chart, render  # noqa: E402

REJECTED = {
    "negative replicas": ({"prefill": {"replicas": -1}}, "/prefill/replicas", "minimum"),
    "unknown mode": ({"mode": "hybrid"}, "/mode", "disaggregated"),
    "bad decode policy": ({"router": {"decodePolicy": "fastest"}}, "/router/decodePolicy", "power_of_two"),
    "bad unified policy": ({"router": {"policy": "sticky"}}, "/router/policy", "cache_aware"),
    "decode pipeline parallel": ({"decode": {"pp": 2}}, "/decode/pp", "must be 1"),
    "prefill pipeline parallel": ({"prefill": {"pp": 2}}, "/prefill/pp", "must be 1"),
    "tensor parallel 0": ({"worker": {"tp": 0}}, "/worker/tp", "minimum"),
    "pipeline parallel 0": ({"worker": {"pp": 0}}, "/worker/pp", "minimum"),
    "data parallel 0": ({"decode": {"dp": 0}}, "/decode/dp", "minimum"),
    "expert parallel 0": ({"prefill": {"ep": 0}}, "/prefill/ep", "minimum"),
    "expert parallel as text": ({"worker": {"ep": "2"}}, "/worker/ep", "integer"),
    "old tensorParallelSize key": ({"worker": {"tensorParallelSize": 2}}, "/worker", "tensorParallelSize"),
    "unknown engine flag": ({"engine": {"speculativeDecoding": True}}, "/engine", "speculativeDecoding"),
    "bad dtype": ({"prefill": {"engine": {"dtype": "int4"}}}, "/prefill/engine/dtype", "bfloat16"),
    "mem fraction of 1": ({"engine": {"memFraction": 1}}, "/engine/memFraction", "exclusiveMaximum"),
    "port as text": ({"router": {"port": "http"}}, "/router/port", "integer"),
    "port out of range": ({"prefill": {"bootstrapPort": 70000}}, "/prefill/bootstrapPort", "maximum"),
    "unknown model source": ({"model": {"source": "s3"}}, "/model/source", "initContainer"),
    "pvc without claim": ({"model": {"pvc": {"claimName": ""}}}, "/model/pvc/claimName", "minLength"),
    "hostPath without path": ({"model": {"source": "hostPath"}}, "/model/hostPath/path", "^/"),
    "init container without image": ({"model": {"source": "initContainer"}},
                                     "/model/initContainer/image/repository", "minLength"),
    "unknown top-level key": ({"replicas": 3}, "additional properties 'replicas'", ""),
    "typo in a worker key": ({"decode": {"replica": 2}}, "/decode", "replica"),
    "bad sampler": ({"otel": {"tracesSampler": "sometimes"}}, "/otel/tracesSampler", "parentbased_traceidratio"),
    "bad scrape interval": ({"metrics": {"serviceMonitor": {"interval": "often"}}},
                            "/metrics/serviceMonitor/interval", "pattern"),
}


@pytest.mark.parametrize("name", REJECTED)
def test_schema_rejects_bad_values_with_a_clear_message(name):
    values, where, what = REJECTED[name]
    with pytest.raises(helm_python.HelmValuesError) as error:
        render(values)
    message = str(error.value)
    assert where in message and what in message, message


@pytest.mark.parametrize("case", CASES)
def test_schema_accepts_the_defaults_and_every_example(case):
    schema = chart().schema
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(chart().merge_values(CASES[case]), schema)


def test_schema_is_the_file_in_the_chart():
    with open(os.path.join(CHART_DIR, "values.schema.json")) as f:
        assert json.load(f) == chart().schema


CHART_CHECKS = {
    "gpus not one per rank": ({"mode": "unified", "worker": {"tp": 2, "gpus": 1}},
                              "worker.gpus (1) must be 0 (CPU) or equal dp x tp x pp (1 x 2 x 1 = 2)"),
    "gpus not one per replica rank": ({"prefill": {"dp": 2, "gpus": 1}},
                                      "prefill.gpus (1) must be 0 (CPU) or equal dp x tp x pp (2 x 1 x 1 = 2)"),
    "gpus not one per rank of each decode replica": ({"decode": {"dp": 2, "tp": 2, "gpus": 2}},
                                                     "decode.gpus (2) must be 0 (CPU) or equal dp x tp x pp (2 x 2 x 1 = 4)"),
    "gpus not one per stage": ({"mode": "unified", "worker": {"tp": 2, "pp": 2, "gpus": 2}},
                               "worker.gpus (2) must be 0 (CPU) or equal dp x tp x pp (1 x 2 x 2 = 4)"),
    "ep not dividing tp": ({"decode": {"tp": 4, "ep": 3, "gpus": 4}},
                           "decode.ep (3) must divide decode.tp (4): the expert-parallel ranks are the tensor"),
    "ep above a tp of 1": ({"mode": "unified", "worker": {"ep": 2, "gpus": 1}},
                           "worker.ep (2) must divide worker.tp (1)"),
    "data parallel with worker metrics": ({"decode": {"dp": 2, "gpus": 2}, "metrics": {"enabled": True}},
                                          "decode.dp (2) with metrics.enabled"),
    "grace shorter than the drain": ({"decode": {"drainTimeoutSeconds": 60, "terminationGracePeriodSeconds": 30}},
                                     "decode.terminationGracePeriodSeconds (30) must exceed"),
    "router tokenizer from an init container": ({"model": {"source": "initContainer", "initContainer": {
        "image": {"repository": "busybox"}}}, "router": {"mountModel": True}}, "router.mountModel needs"),
}


@pytest.mark.parametrize("name", CHART_CHECKS)
def test_templates_reject_inconsistent_values(name):
    values, message = CHART_CHECKS[name]
    with pytest.raises(helm_python.HelmError) as error:
        render(values)
    assert message in str(error.value)
