"""deploy/serve.yaml, the sample Kubernetes Deployment for `python -m detpipe.serve` (issue 49.5): its command is one the
server's own command-line parser accepts, and its probes, ports and scrape annotations name the server's routes and
port. Nothing here talks to a Kubernetes API server (the test machines have none)."""
from __future__ import annotations

from pathlib import Path

import yaml

from detpipe.serve.__main__ import parser
from detpipe.serve.metrics import ROUTES

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "serve.yaml"


def _manifests() -> list[dict]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def test_sample_deployment_runs_the_server_with_its_probes_and_metrics():
    """The Deployment's container runs ``python -m detpipe.serve`` with options the parser accepts (listening on
    all addresses, on the port the probes, the Service and the scrape annotations use); readiness is ``/readyz``,
    liveness ``/healthz``, the scrape path ``/metrics`` (all routes of the server); the termination grace exceeds
    ``--graceful-timeout``; the Service selects the Deployment's pods."""
    deployment, service = _manifests()
    assert (deployment["apiVersion"], deployment["kind"]) == ("apps/v1", "Deployment")
    assert (service["apiVersion"], service["kind"]) == ("v1", "Service")
    template = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    (container,) = template["spec"]["containers"]
    command = [str(c) for c in container["command"]]
    assert command[:3] == ["python", "-m", "detpipe.serve"], command
    args = parser().parse_args(command[3:])       # exits (SystemExit) on an unknown option or a bad value
    assert args.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": args.port}
    ready, live = container["readinessProbe"]["httpGet"], container["livenessProbe"]["httpGet"]
    assert (ready["path"], live["path"]) == ("/readyz", "/healthz") and ready["port"] == live["port"] == "http"
    notes = template["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and int(notes["prometheus.io/port"]) == args.port
    assert notes["prometheus.io/path"] == "/metrics"
    assert {"/readyz", "/healthz", "/metrics"} <= set(ROUTES)
    assert template["spec"]["terminationGracePeriodSeconds"] > args.graceful_timeout
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    mount = container["volumeMounts"][0]
    assert mount["mountPath"] == f"{container['workingDir']}/models" and args.model.startswith("models/")
