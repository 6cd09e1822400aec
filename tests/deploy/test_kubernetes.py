"""deploy/kubernetes/ checked offline: every object against the Kubernetes 1.31 schemas
(kubernetes-validate) or, for custom resources, against their projects' published CRD schemas;
the kustomizations' references; every flag given to `pagoda` parsed by pagoda's own parser; and
every metric the autoscalers query exported by pagoda's /metrics (a real server's, and the
router's exporter)."""

from __future__ import annotations

import httpx
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from manifests import (
    CRD_KINDS, KUSTOMIZE_KINDS, MANIFESTS, all_documents, api_objects, crd_errors, crd_schema, hpa_metric_names,
    pagoda_commands, queried_metrics,
)
from pagoda.cli import build_parser
from pagoda.router.forecast import ForecastConfig, LoadForecaster
from pagoda.router.prometheus import RouterMetrics
from server_process import start_server, stop_process

KUBERNETES_VERSION = "1.31.0"  # the oldest release the manifests promise to work on (docs/kubernetes.md)
OBJECTS = api_objects()


def test_every_kind_we_ship_is_checked():
    kinds = {m.doc["kind"] for m in OBJECTS}
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "Secret", "ConfigMap",
            "LeaderWorkerSet", "ScaledObject", "ServiceMonitor"} <= kinds


@pytest.mark.parametrize("m", [m for m in OBJECTS if (m.doc["apiVersion"], m.doc["kind"]) not in CRD_KINDS],
                         ids=lambda m: m.name)
def test_builtin_objects_are_valid_kubernetes(m):
    kubernetes_validate.validate(m.doc, KUBERNETES_VERSION, strict=True)  # strict: unknown fields fail


@pytest.mark.parametrize("m", [m for m in OBJECTS if (m.doc["apiVersion"], m.doc["kind"]) in CRD_KINDS],
                         ids=lambda m: m.name)
def test_custom_resources_match_their_published_crd_schemas(m):
    schema = crd_schema(CRD_KINDS[m.doc["apiVersion"], m.doc["kind"]])
    assert f"{schema['group']}/{schema['version']}" == m.doc["apiVersion"] and schema["kind"] == m.doc["kind"]
    assert crd_errors(m.doc, schema["schema"]) == []


def test_the_crd_check_catches_a_typo():
    lws = next(m.doc for m in OBJECTS if m.doc["kind"] == "LeaderWorkerSet")
    schema = crd_schema(CRD_KINDS[lws["apiVersion"], "LeaderWorkerSet"])["schema"]
    typo = {**lws, "spec": {**lws["spec"], "replica": 2}}
    assert crd_errors(typo, schema) == ["/spec/replica: not in the schema"]
    wrong = {**lws, "spec": {**lws["spec"], "replicas": "two"}}
    assert any("'two' is not of type 'integer'" in e for e in crd_errors(wrong, schema))


@pytest.mark.parametrize("m", [m for m in all_documents() if m.doc["kind"] in KUSTOMIZE_KINDS], ids=lambda m: m.name)
def test_kustomizations_name_files_that_exist(m):
    """Structural only: kustomize itself is not run here (no binary on PyPI)."""
    here = m.path.parent
    for entry in m.doc.get("resources", []) + m.doc.get("components", []):
        target = here / entry
        assert target.is_file() or (target / "kustomization.yaml").is_file(), f"{m.name}: {entry} is missing"
    for patch in m.doc.get("patches", []):
        assert "patch" in patch and yaml.safe_load(patch["patch"]) is not None


def test_the_base_lists_every_file_in_it_but_the_secret_example():
    base = yaml.safe_load((MANIFESTS / "base" / "kustomization.yaml").read_text())
    files = {p.name for p in (MANIFESTS / "base").glob("*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}
    assert set(base["resources"]) == files


@pytest.mark.parametrize("where,argv", pagoda_commands(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_pagoda_flag_is_real(where, argv):
    ns = build_parser().parse_args(argv)  # an unknown flag or a bad value exits here
    assert ns.command in ("serve", "router", "pull"), where


def test_the_replicas_pull_the_model_they_serve():
    commands = [argv for _, argv in pagoda_commands()]
    pulled = {argv[1] for argv in commands if argv[0] == "pull"}
    served = {build_parser().parse_args(argv).model for argv in commands if argv[0] == "serve"}
    assert served and {m[0] if isinstance(m, list) else m for m in served} == pulled


def test_the_hpa_asks_for_what_the_adapter_serves():
    """The adapter renames pagoda:x to pagoda_x; the HPA must ask for those names."""
    renamed = {name.replace("pagoda:", "pagoda_") for name in queried_metrics()}
    assert hpa_metric_names() <= renamed


def _metric_names(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


def test_every_queried_metric_is_exported(tiny_llama):
    """Each pagoda:* the HPA rules and KEDA query, in a real `pagoda serve`'s /metrics or the
    router's exporter (a router with a capacity, as base/router.yaml runs it)."""
    proc, base = start_server(tiny_llama)
    try:
        served = _metric_names(httpx.get(f"{base}/metrics", timeout=10).text)
    finally:
        stop_process(proc)
    router = RouterMetrics(lambda: [], LoadForecaster(ForecastConfig(replica_capacity=2.34)))
    routed = _metric_names(router.render().decode())
    queried = queried_metrics()
    assert {"pagoda:num_requests_waiting", "pagoda:desired_replicas"} <= queried
    assert queried <= served | routed, queried - (served | routed)
