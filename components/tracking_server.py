"""Where a run's record goes and whether it can get there: the tracking URI (`tracking.uri`, else
`$MLFLOW_TRACKING_URI`, else the embedded store), the MLflow client, the experiment (tagged as model
training), and the health probe that keeps a dead server from stalling a stage for MLflow's minutes
of retries (`server_reachable`, `check_server`).
"""

from __future__ import annotations

import os

from components.config import Params

EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}  # the UI's model-training view


def tracking_uri(params: Params | None = None) -> str:
    if params is not None and params.tracking.uri:
        return params.tracking.uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    embedded = params.tracking.embedded_uri if params is not None else "sqlite:///mlflow.db"
    return embedded


def mlflow_client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def experiment_id(client, name: str) -> str:
    """The experiment `name` (created if missing), tagged as model training."""
    exp = client.get_experiment_by_name(name)
    if exp is None:
        return client.create_experiment(name, tags=EXPERIMENT_KIND)
    for k, v in EXPERIMENT_KIND.items():
        if exp.tags.get(k) != v:
            client.set_experiment_tag(exp.experiment_id, k, v)
    return exp.experiment_id


def upload_large(params: Params, uri: str) -> bool:
    """tracking.upload_large_artifacts, or when null: upload when `uri` is a tracking server."""
    choice = params.tracking.upload_large_artifacts
    return is_server(uri) if choice is None else choice


def _health_problem(uri: str, timeout: float) -> str | None:
    """None when `uri` is not an http(s) server or its /health answers 200, else what went wrong."""
    if not uri.startswith(("http://", "https://")):
        return None
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout) as r:
            return None if r.status == 200 else f"HTTP {r.status}"
    except (urllib.error.URLError, OSError) as e:
        return str(getattr(e, "reason", e))


def server_reachable(uri: str, timeout: float = 2.0) -> bool:
    """A quick probe before talking to a tracking server. MLflow's own HTTP client retries a dead
    server for ~4 minutes per call (MLFLOW_HTTP_REQUEST_MAX_RETRIES=7, backoff factor 2), so a
    call made while the server is down would stall the metric flusher or a stage's exit for that long."""
    return _health_problem(uri, timeout) is None


def check_server(uri: str, timeout: float = 5.0) -> None:
    """Fail fast, with a clear message, when an http(s) tracking server does not answer.

    Chosen over a silent fallback to the embedded store: a run logged somewhere the user is not
    looking is worse than a stage that stops in seconds and says which URL to fix.
    """
    problem = _health_problem(uri, timeout)
    if problem is None:
        return
    raise ConnectionError(
        f"MLflow tracking server {uri} is not answering ({problem}). Start it (`bash infra/servers.sh up mlflow`), "
        f"fix MLFLOW_TRACKING_URI / tracking.uri, or unset both to use the embedded store ({Params().tracking.embedded_uri}).")
