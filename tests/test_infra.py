"""The local servers of `infra/` (moto S3, MLflow, Prefect) and the deployment files.

    .venv/bin/python -m pytest tests/test_infra.py -q              # S3 + MLflow + files, ~30-40 s
    .venv/bin/python -m pytest tests/test_infra.py -q -m slow      # Prefect server/worker, servers.sh

The servers are the real processes, started by the fixtures of tests/servers.py on free ports.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
from pathlib import Path

import pytest
import yaml

from tests.servers import (
    LocalServer,
    S3Server,
    ServerError,
    _load_s3_state,
    free_port,
    http_get,
    http_json,
    port_open,
)

pytest_plugins = ["tests.servers"]

REPO = Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"
PLACEHOLDER = re.compile(r"\{\{\s*([\w.-]+)\s*\}\}")


def group_members(pgid: int | str) -> list[int]:
    """PIDs whose process group is `pgid` (any user, any parent)."""
    out = subprocess.run(["ps", "-eo", "pid=,pgid="], capture_output=True, text=True, check=True).stdout
    return [int(p) for p, g in (line.split() for line in out.splitlines()) if int(g) == int(pgid)]


# ---------------------------------------------------------------------------------------------
# S3 (moto)
# ---------------------------------------------------------------------------------------------
@pytest.mark.servers
def test_s3_buckets_exist_and_store_objects(s3_server):
    s3 = s3_server.client()
    names = {b["Name"] for b in s3.list_buckets()["Buckets"]}
    assert {"retro-realm-dvc", "retro-realm-mlflow", "retro-realm-data"} <= names
    s3.put_object(Bucket="retro-realm-data", Key="corpus/a b.txt", Body=b"hello")
    assert s3.get_object(Bucket="retro-realm-data", Key="corpus/a b.txt")["Body"].read() == b"hello"
    assert s3_server.env["AWS_ENDPOINT_URL"] == s3_server.url
    assert s3_server.host == "127.0.0.1"


@pytest.mark.servers
def test_s3_stop_start_keeps_objects_on_the_same_port(s3_server):
    s3 = s3_server.client()
    s3.put_object(Bucket="retro-realm-dvc", Key="files/md5/ab/cdef", Body=b"\x00\x01blob")
    port, pid = s3_server.port, s3_server.process.pid
    with s3_server.stopped():
        assert not port_open("127.0.0.1", port)
        assert not s3_server.is_running()
    assert s3_server.port == port and s3_server.process.pid != pid
    body = s3_server.client().get_object(Bucket="retro-realm-dvc", Key="files/md5/ab/cdef")["Body"].read()
    assert body == b"\x00\x01blob"


@pytest.mark.servers
@pytest.mark.parametrize("threads", [1, 8])
def test_s3_snapshot_restores_every_object_byte_for_byte(tmp_path, threads):
    """infra/s3_state.py into a second, empty endpoint: keys that are no safe path, an empty object,
    and one above the single-request size (a ranged download and a multipart upload)."""
    state = _load_s3_state()
    objects = {"../escape": b"up", "a/": b"", "a/b/": b"dir-like", "deep/\u00e9 \u00fc.txt": b"unicode",
               "big.bin": os.urandom(state.SINGLE_REQUEST_BYTES + 1024 * 1024),
               **{f"many/{i:03d}": os.urandom(64) for i in range(40)}}
    source, target = S3Server(tmp_path / "source").start(), S3Server(tmp_path / "target").start()
    try:
        for key, body in objects.items():
            source.client().put_object(Bucket="retro-realm-dvc", Key=key, Body=body)
        assert state.snapshot(source.client(), tmp_path / "snap", threads=threads) == len(objects)
        assert state.restore(target.client(), tmp_path / "snap", threads=threads) == len(objects)
        got = {key: target.client().get_object(Bucket="retro-realm-dvc", Key=key)["Body"].read() for key in objects}
        assert got == objects
        assert {b["Name"] for b in target.client().list_buckets()["Buckets"]} >= set(state.DEFAULT_BUCKETS)
    finally:
        source.kill()
        target.kill()


# ---------------------------------------------------------------------------------------------
# MLflow (through the tracking server, artifacts proxied to S3)
# ---------------------------------------------------------------------------------------------
def _log_run(client, tmp_path: Path, name: str) -> tuple[str, bytes]:
    exp = client.get_experiment_by_name("infra-test")
    exp_id = exp.experiment_id if exp else client.create_experiment("infra-test")
    run = client.create_run(exp_id, run_name=name)
    client.log_metric(run.info.run_id, "loss", 0.25, step=3)
    client.log_param(run.info.run_id, "stage", "evaluate")
    payload = f"artifact of {name}\n".encode()
    (tmp_path / "report.txt").write_bytes(payload)
    client.log_artifact(run.info.run_id, str(tmp_path / "report.txt"), artifact_path="reports")
    client.set_terminated(run.info.run_id)
    return run.info.run_id, payload


@pytest.mark.servers
def test_mlflow_run_metric_and_artifact_land_in_s3(mlflow_server, s3_server, tmp_path):
    client = mlflow_server.client()
    run_id, payload = _log_run(client, tmp_path, "artifact-check")

    run = client.get_run(run_id)
    assert run.data.metrics["loss"] == 0.25
    # Proxied: the client only knows the tracking server, never the bucket.
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")

    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket="retro-realm-mlflow").get("Contents", [])]
    key = next(k for k in keys if run_id in k and k.endswith("reports/report.txt"))
    assert s3_server.client().get_object(Bucket="retro-realm-mlflow", Key=key)["Body"].read() == payload


@pytest.mark.servers
def test_mlflow_stop_start_keeps_runs_and_artifacts(mlflow_server, tmp_path):
    client = mlflow_server.client()
    run_id, payload = _log_run(client, tmp_path, "restart-check")
    port, pgid = mlflow_server.port, mlflow_server.process.pid
    # Killing only the `mlflow server` PID would orphan its uvicorn child: stop() ends the group.
    assert len(group_members(pgid)) >= 2, "expected the mlflow CLI and its uvicorn child in one group"

    with mlflow_server.stopped():
        assert group_members(pgid) == []
        with pytest.raises(OSError):
            http_get(mlflow_server.health_url, timeout=1)

    assert mlflow_server.port == port and mlflow_server.healthy()
    client = mlflow_server.client()
    run = client.get_run(run_id)
    assert run.data.metrics["loss"] == 0.25 and run.data.params["stage"] == "evaluate"
    local = client.download_artifacts(run_id, "reports/report.txt", str(tmp_path / "dl"))
    assert Path(local).read_bytes() == payload


# ---------------------------------------------------------------------------------------------
# fixture behaviour: errors say why, ports are free
# ---------------------------------------------------------------------------------------------
class _CrashingServer(LocalServer):
    name = "crasher"
    start_timeout = 20.0

    def command(self):
        return [sys.executable, "-c", "import sys; print('boom: no config'); sys.exit(3)"]


def test_failed_start_reports_exit_code_command_and_log_tail(tmp_path):
    with pytest.raises(ServerError) as err:
        _CrashingServer(tmp_path).start()
    msg = str(err.value)
    assert "exited with code 3" in msg and "boom: no config" in msg and "command:" in msg


def test_start_on_a_taken_port_fails_clearly(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(ServerError, match=f"port {port}.*in use"):
            S3Server(tmp_path, port=port).start()
        assert time.monotonic() - t0 < 30


def test_free_port_is_bindable_on_loopback():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# ---------------------------------------------------------------------------------------------
# scripts and deployment files (syntax/structure only: no Docker engine or cluster here)
# ---------------------------------------------------------------------------------------------
def test_shell_scripts_parse_and_env_sh_prints_the_urls(tmp_path):
    for script in ("servers.sh", "env.sh"):
        subprocess.run(["bash", "-n", str(INFRA / script)], check=True)
    (tmp_path / "mlflow").mkdir()
    (tmp_path / "mlflow" / "port").write_text("5123\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MLFLOW_", "PREFECT_", "RR_"))}
    env["RR_SERVERS_DIR"] = str(tmp_path)
    out = subprocess.run(["bash", str(INFRA / "env.sh")], env=env, capture_output=True, text=True, check=True).stdout
    exports = dict(re.findall(r"^export (\w+)=(\S*)$", out, re.M))
    assert exports["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5123"  # read from .servers/mlflow/port
    assert exports["PREFECT_API_URL"] == "http://127.0.0.1:4200/api"
    assert exports["AWS_ENDPOINT_URL"] == exports["MLFLOW_S3_ENDPOINT_URL"] == "http://127.0.0.1:9000"
    assert exports["AWS_ACCESS_KEY_ID"] == "testing"  # moto's dummy only when none is set
    env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"] = "AKIAREALKEY", "realsecret"
    out = subprocess.run(["bash", str(INFRA / "env.sh")], env=env, capture_output=True, text=True, check=True).stdout
    assert "AWS_ACCESS_KEY_ID" not in out and "realsecret" not in out  # never echoes real keys


def test_compose_has_the_four_services_on_loopback_without_secrets():
    compose = yaml.safe_load((INFRA / "compose.yaml").read_text())
    services = compose["services"]
    assert {"mlflow", "prefect-server", "postgres", "minio", "minio-init"} <= set(services)
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    init = " ".join(services["minio-init"]["command"])
    assert all(b in init for b in ("RR_DVC_BUCKET", "RR_MLFLOW_BUCKET", "RR_DATA_BUCKET")) and "mc mb" in init
    mlflow_env = services["mlflow"]["environment"]
    assert mlflow_env["MLFLOW_BACKEND_STORE_URI"].startswith("postgresql://")
    userinfo = re.sub(r"\$\{[^}]*\}", "USER", mlflow_env["MLFLOW_BACKEND_STORE_URI"].split("//")[1].split("@")[0])
    assert ":" not in userinfo  # no password in the URI (psycopg2 reads PGPASSWORD)
    assert mlflow_env["MLFLOW_ARTIFACTS_DESTINATION"].startswith("s3://")
    assert services["prefect-server"]["environment"]["PREFECT_SERVER_DATABASE_DRIVER"] == "postgresql+asyncpg"
    assert set(services["mlflow"]["depends_on"]) == {"postgres", "minio-init"}
    # Every password is interpolated from the environment, none is written in the file.
    text = (INFRA / "compose.yaml").read_text()
    for key in ("POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD", "AWS_SECRET_ACCESS_KEY", "PGPASSWORD"):
        for value in re.findall(rf"^\s*{key}:\s*(.+)$", text, re.M):
            assert value.strip().startswith("${"), f"{key} has a literal value"


def _placeholders(obj) -> set[str]:
    return set(PLACEHOLDER.findall(json.dumps(obj)))


def _render(template: dict) -> dict:
    """Fill `{{ var }}` with the variables' defaults, as a Prefect worker does (whole-string
    placeholders keep the value's type; unset ones drop out)."""
    defaults = {k: v.get("default") for k, v in template["variables"]["properties"].items()}

    def fill(node):
        if isinstance(node, dict):
            return {k: fill(v) for k, v in node.items()}
        if isinstance(node, list):
            return [fill(v) for v in node]
        if isinstance(node, str):
            m = PLACEHOLDER.fullmatch(node.strip())
            if m:
                return defaults.get(m.group(1))
            return PLACEHOLDER.sub(lambda mm: str(defaults.get(mm.group(1), "")), node)
        return node

    return fill(template["job_configuration"])


def test_docker_gpu_job_template_requests_gpus():
    tmpl = json.loads((INFRA / "prefect" / "docker-gpu-job-template.json").read_text())
    assert _placeholders(tmpl["job_configuration"]) <= set(tmpl["variables"]["properties"])
    job = _render(tmpl)
    (req,) = job["container_create_kwargs"]["device_requests"]
    assert req["capabilities"] == [["gpu"]] and req["driver"] == "nvidia"
    assert req["count"] == -1  # all GPUs, as an int after templating
    assert job["container_create_kwargs"]["shm_size"]
    assert job["image"] == "retro-realm-gpu:latest" and job["network_mode"] == "host"


def test_k8s_gpu_job_template_limits_nvidia_gpus():
    text = (INFRA / "prefect" / "k8s-gpu-job-template.yaml").read_text()
    tmpl = yaml.safe_load(text)
    assert _placeholders(tmpl["job_configuration"]) <= set(tmpl["variables"]["properties"])
    job = _render(tmpl)
    (container,) = job["job_manifest"]["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert job["job_manifest"]["kind"] == "Job"
    assert "--nnodes" in text and "rdzv" in text  # the multi-node note


def test_k8s_multinode_template_is_an_indexed_job_with_a_rendezvous_on_pod_0():
    tmpl = yaml.safe_load((INFRA / "prefect" / "k8s-gpu-multinode-job-template.yaml").read_text())
    assert _placeholders(tmpl["job_configuration"]) <= set(tmpl["variables"]["properties"])
    job = _render(tmpl)
    spec = job["job_manifest"]["spec"]
    nnodes = tmpl["variables"]["properties"]["nnodes"]["default"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == nnodes >= 2
    assert spec["backoffLimit"] == 0  # a failed node fails the run; no lone retry into a dead rendezvous
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == tmpl["variables"]["properties"]["gpus_per_node"]["default"]
    script = container["command"][2]
    assert container["command"][:2] == ["/bin/sh", "-c"] and "python -m flows._torchrun --join" in script
    assert 'exec "$@"' in script and "JOB_COMPLETION_INDEX" in script  # pod 0 runs Prefect's command (args)
    svc = yaml.safe_load((INFRA / "prefect" / "k8s-rendezvous-service.yaml").read_text())
    assert svc["kind"] == "Service" and svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert pod["subdomain"] == svc["metadata"]["name"] and f"-0.{svc['metadata']['name']}:29400" in script
    assert svc["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["port"] == tmpl["variables"]["properties"]["rendezvous_port"]["default"]
    # the script sets what launch_command reads, and sh accepts it
    from components.training.distributed import ENV_RDZV_ENDPOINT, ENV_RDZV_ID
    assert f"{ENV_RDZV_ENDPOINT}=" in script and f"{ENV_RDZV_ID}=" in script
    env = {**os.environ, "HOSTNAME": "rr-train-x7k-0", "JOB_COMPLETION_INDEX": "0", "PREFECT__FLOW_RUN_ID": "fr1"}
    out = subprocess.run(["/bin/sh", "-c", script, "rr-node", "sh", "-c", 'echo "$RR_RDZV_ENDPOINT $RR_RDZV_ID $RR_NNODES"'],
                         env=env, capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == [f"rr-train-x7k-0.{svc['metadata']['name']}:29400", "fr1", str(nnodes)], out.stderr


def test_gpu_dockerfile_swaps_torch_and_faiss_for_cuda_builds():
    text = (INFRA / "Dockerfile.gpu").read_text()
    assert re.search(r"^FROM \$\{CUDA_IMAGE\}", text, re.M) and "nvidia/cuda:" in text
    assert "TORCH_VERSION=2.13.0" in text and "download.pytorch.org/whl/${TORCH_CUDA}" in text
    assert "faiss-gpu-cu12==" in text and "requirements/lock.txt" in text
    assert "grep -vE '^(torch|faiss-cpu)=='" in text
    lock = (REPO / "requirements" / "lock.txt").read_text()
    assert re.search(r"^torch==2\.13\.0$", lock, re.M) and re.search(r"^faiss-cpu==", lock, re.M)
    kept = [l for l in lock.splitlines() if re.match(r"^[A-Za-z0-9_.-]+==", l) and not re.match(r"^(torch|faiss-cpu)==", l)]
    assert kept and not any(l.startswith(("torch==", "faiss-cpu==")) for l in kept)


# ---------------------------------------------------------------------------------------------
# Prefect: server, process pool, worker, a flow run through the worker (slow: ~30-60 s)
# ---------------------------------------------------------------------------------------------
FLOW_SOURCE = textwrap.dedent(
    """
    from pathlib import Path
    from prefect import flow

    @flow(name="rr-infra-hello")
    def hello(x: int = 1, out: str = "out.txt") -> int:
        Path(out).write_text(str(x * 2))
        return x * 2
    """
)


def _run_deployment(prefect_server, flow_dir: Path, x: int, timeout: float = 180.0) -> dict:
    api = prefect_server.api_url
    flow_id = http_json("POST", f"{api}/flows/", {"name": "rr-infra-hello"})["id"]
    dep = http_json("POST", f"{api}/deployments/", {
        "name": "infra-test", "flow_id": flow_id, "work_pool_name": prefect_server.pool,
        "entrypoint": "hello_flow.py:hello", "enforce_parameter_schema": False,
        "pull_steps": [{"prefect.deployments.steps.set_working_directory": {"directory": str(flow_dir)}}],
    })
    run = http_json("POST", f"{api}/deployments/{dep['id']}/create_flow_run",
                    {"parameters": {"x": x, "out": str(flow_dir / f"out-{x}.txt")}})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = http_json("GET", f"{api}/flow_runs/{run['id']}")["state"]
        if state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return {"id": run["id"], "state": state["type"], "message": state.get("message")}
        time.sleep(0.5)
    raise AssertionError(f"flow run {run['id']} not finished after {timeout}s; worker log:\n"
                         f"{prefect_server.worker.log_tail()}")


@pytest.mark.slow
@pytest.mark.servers
def test_prefect_worker_runs_a_flow_and_server_restart_keeps_state(prefect_server, tmp_path):
    health = http_get(prefect_server.api_url + "/health")
    assert health[0] == 200
    assert prefect_server.work_pool()["type"] == "process"
    assert prefect_server.worker_online()

    (tmp_path / "hello_flow.py").write_text(FLOW_SOURCE)
    result = _run_deployment(prefect_server, tmp_path, x=21)
    assert result["state"] == "COMPLETED", (result, prefect_server.worker.log_tail())
    assert (tmp_path / "out-21.txt").read_text() == "42"

    port = prefect_server.port
    with prefect_server.stopped():
        assert not port_open("127.0.0.1", port) and not prefect_server.worker.group_alive()
    assert prefect_server.port == port and prefect_server.worker_online()
    assert http_json("GET", f"{prefect_server.api_url}/flow_runs/{result['id']}")["state"]["type"] == "COMPLETED"


@pytest.mark.slow
@pytest.mark.servers
def test_gpu_job_templates_are_accepted_by_a_prefect_server(prefect_server):
    """The server validates that every placeholder of a base job template is a declared variable."""
    templates = {
        "docker": json.loads((INFRA / "prefect" / "docker-gpu-job-template.json").read_text()),
        "kubernetes": yaml.safe_load((INFRA / "prefect" / "k8s-gpu-job-template.yaml").read_text()),
        "kubernetes-multinode": yaml.safe_load((INFRA / "prefect" / "k8s-gpu-multinode-job-template.yaml").read_text()),
    }
    for kind, tmpl in templates.items():
        name, pool_type = f"rr-test-gpu-{kind}", kind.split("-")[0]
        http_json("POST", f"{prefect_server.api_url}/work_pools/", {"name": name, "type": pool_type, "base_job_template": tmpl})
        stored = http_json("GET", f"{prefect_server.api_url}/work_pools/{name}")
        assert stored["type"] == pool_type and stored["base_job_template"] == tmpl
    broken = json.loads(json.dumps(templates["docker"]))
    del broken["variables"]["properties"]["gpu_count"]
    with pytest.raises(urllib.error.HTTPError) as err:
        http_json("POST", f"{prefect_server.api_url}/work_pools/", {"name": "rr-broken", "type": "docker", "base_job_template": broken})
    assert err.value.code == 422


# ---------------------------------------------------------------------------------------------
# infra/servers.sh end to end (slow: starts the real servers on free ports in a tmp state dir)
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.servers
def test_servers_sh_up_status_down_and_s3_snapshot(tmp_path):
    """`up all` starts four process groups (moto, mlflow, prefect, worker); `down` leaves none."""
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MLFLOW_", "PREFECT_", "RR_"))}
    env.update(RR_SERVERS_DIR=str(state), RR_S3_PORT=str(free_port()), RR_MLFLOW_PORT=str(free_port()),
               RR_PREFECT_PORT=str(free_port()), RR_VENV=str(Path(sys.executable).parent.parent))

    def sh(*args, check=True):
        r = subprocess.run(["bash", str(INFRA / "servers.sh"), *args], env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0 or not check, f"servers.sh {' '.join(args)}: rc={r.returncode}\n{r.stdout}\n{r.stderr}"
        return r

    try:
        out = sh("up", "all").stdout
        for port in (env["RR_S3_PORT"], env["RR_MLFLOW_PORT"], env["RR_PREFECT_PORT"]):
            assert f"http://127.0.0.1:{port}" in out
        status = sh("status").stdout
        for name in ("s3", "mlflow", "prefect", "worker"):
            assert re.search(rf"^{name}\s+up", status, re.M), status
        pgids = {n: (state / n / "pid").read_text().strip() for n in ("s3", "mlflow", "prefect")}
        pgids["worker"] = (state / "prefect" / "worker.pid").read_text().strip()
        assert len(set(pgids.values())) == 4  # one process group each
        assert len(group_members(pgids["mlflow"])) >= 2  # CLI + uvicorn, one group
        pool = http_json("GET", f"http://127.0.0.1:{env['RR_PREFECT_PORT']}/api/work_pools/retro-realm-process")
        assert pool["type"] == "process"

        s3_env = {**env, **{"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}}
        endpoint = f"http://127.0.0.1:{env['RR_S3_PORT']}"
        put = ("import boto3,sys; s=boto3.client('s3',endpoint_url=sys.argv[1],region_name='us-east-1');"
               "s.put_object(Bucket='retro-realm-dvc',Key='k/1',Body=b'v1');"
               "print(sorted(b['Name'] for b in s.list_buckets()['Buckets']))")
        buckets = subprocess.run([sys.executable, "-c", put, endpoint], env=s3_env, capture_output=True, text=True, check=True).stdout
        assert "retro-realm-data" in buckets and "retro-realm-mlflow" in buckets

        sh("down", "all")
        assert all(group_members(g) == [] for g in pgids.values())
        assert not (state / "s3" / "pid").exists() and (state / "s3" / "snapshot" / "manifest.json").exists()

        sh("up", "s3")
        get = ("import boto3,sys; s=boto3.client('s3',endpoint_url=sys.argv[1],region_name='us-east-1');"
               "print(s.get_object(Bucket='retro-realm-dvc',Key='k/1')['Body'].read().decode())")
        assert subprocess.run([sys.executable, "-c", get, endpoint], env=s3_env, capture_output=True,
                              text=True, check=True).stdout.strip() == "v1"
    finally:
        sh("down", "all", check=False)
    assert not any((state / n / "pid").exists() for n in ("s3", "mlflow", "prefect"))
