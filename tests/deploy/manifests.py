"""The Kubernetes manifests under deploy/kubernetes/, read for the tests: every object, the
pagoda commands their containers run, the PromQL their autoscalers query, and the checks against
the published CRD schemas (crd_schemas/, see its README) of the kinds kubernetes-validate lacks."""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
SCHEMAS = Path(__file__).resolve().parent / "crd_schemas"
KUSTOMIZE_KINDS = {"Kustomization", "Component"}  # kustomize's own files, not API objects
# Custom resources and the CRD schema file (group/kind/version) each is checked against.
CRD_KINDS = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset.x-k8s.io_leaderworkersets.v1",
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobjects.v1alpha1",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.v1",
}
# $(VAR) references the kubelet expands in args, with values of the kind they take at run time
ENV_EXAMPLES = {"LWS_LEADER_ADDRESS": "pagoda-replica-0.pagoda-replica.pagoda", "LWS_WORKER_INDEX": "1"}


@dataclass(frozen=True)
class Manifest:
    path: Path
    doc: dict[str, Any]

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(MANIFESTS)}:{self.doc.get('kind')}/{self.doc.get('metadata', {}).get('name')}"


def all_documents() -> list[Manifest]:
    return [Manifest(path, doc) for path in sorted(MANIFESTS.rglob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def api_objects() -> list[Manifest]:
    return [m for m in all_documents() if m.doc["kind"] not in KUSTOMIZE_KINDS]


@cache
def crd_schema(name: str) -> dict[str, Any]:
    with gzip.open(SCHEMAS / f"{name}.json.gz") as f:
        return json.load(f)


def crd_errors(doc: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """The schema's violations, and the fields it does not know (the API server prunes those
    silently, so a typo would be lost without a word)."""
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]
    return errors + list(_unknown_fields(doc, schema, ""))


def _unknown_fields(value: Any, schema: dict[str, Any], where: str) -> Iterator[str]:
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(value, dict):
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, child in value.items():
            if properties is not None and key in properties:
                yield from _unknown_fields(child, properties[key], f"{where}/{key}")
            elif isinstance(extra, dict):
                yield from _unknown_fields(child, extra, f"{where}/{key}")
            elif properties is not None:
                yield f"{where}/{key}: not in the schema"
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from _unknown_fields(item, schema["items"], f"{where}/{i}")


def pod_specs(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The pod templates' specs of a Deployment or a LeaderWorkerSet."""
    spec = doc.get("spec", {})
    if "template" in spec:
        yield spec["template"]["spec"]
    lws = spec.get("leaderWorkerTemplate", {})
    for template in ("leaderTemplate", "workerTemplate"):
        if template in lws:
            yield lws[template]["spec"]


def pagoda_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `pagoda`) of every container that runs pagoda, $(VAR)s filled in."""
    found = []
    for m in api_objects():
        for spec in pod_specs(m.doc):
            for c in spec.get("initContainers", []) + spec.get("containers", []):
                argv = c.get("command", []) + c.get("args", [])
                if argv[:1] == ["pagoda"]:
                    filled = [re.sub(r"\$\((\w+)\)", lambda v: ENV_EXAMPLES[v.group(1)], a) for a in argv[1:]]
                    found.append((f"{m.name} {c['name']}", filled))
    return found


METRIC = re.compile(r"\bpagoda:[a-z_]+")


def queried_metrics() -> set[str]:
    """Every pagoda metric the autoscaling configs query: KEDA's PromQL, the adapter's series."""
    names: set[str] = set()
    for m in api_objects():
        if m.doc["kind"] == "ScaledObject":
            for trigger in m.doc["spec"]["triggers"]:
                names.update(METRIC.findall(trigger["metadata"]["query"]))
        if m.doc["kind"] == "ConfigMap" and m.doc["metadata"]["name"] == "adapter-config":
            rules = yaml.safe_load(m.doc["data"]["config.yaml"])
            for rule in rules.get("rules", []) + rules.get("externalRules", []):
                names.update(METRIC.findall(rule["seriesQuery"]))
    return names


def hpa_metric_names() -> set[str]:
    """The metric names the HPA asks the custom / external metrics API for."""
    names = set()
    for m in api_objects():
        if m.doc["kind"] == "HorizontalPodAutoscaler":
            for metric in m.doc["spec"]["metrics"]:
                names.add(metric[metric["type"].lower()]["metric"]["name"])
    return names
