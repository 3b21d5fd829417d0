"""S3 reliability against the real local endpoint (moto_server, `tests/servers.py`): the `s3://`
corpus source end to end, an endpoint that is down or hangs, and uploads that fail or are killed
half-way. Expected: an `S3Error` naming bucket/key and endpoint after botocore's own retries, in
bounded time, and never a partial object under the final key."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from components.config_stages import DataParams
from components.data.errors import DataError
from components.data.prepare import prepare_corpus
from components.io import S3Error, s3_client, s3_download_prefix, s3_upload_file
from tests.conftest import ROOT

BUCKET = "retro-realm-data"


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The endpoint's env (moto's dummy keys + AWS_ENDPOINT_URL) and a unique key prefix."""
    if not s3_server.is_running():
        s3_server.start()
    s3_server.patch_env(monkeypatch)
    return s3_server, f"t-{uuid.uuid4().hex[:8]}"


def _put(client, key: str, body: str | bytes) -> None:
    client.put_object(Bucket=BUCKET, Key=key, Body=body.encode() if isinstance(body, str) else body)


def _keys(client, prefix: str) -> list[str]:
    return [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])]


# ----------------------------------------------------------------------------------------------
# happy paths: objects uploaded with boto3 -> prepare_corpus(source=s3) -> passages
# ----------------------------------------------------------------------------------------------
def test_s3_prefix_with_mixed_jsonl_and_txt_becomes_passages(s3, tmp_path):
    server, prefix = s3
    c = server.client()
    _put(c, f"{prefix}/corpus/a.jsonl", '{"id": "d1", "title": "Ardel", "text": "The Ardel River flows north."}\n'
                                         '{"id": "d2", "text": "Kessaville lies on its bank."}\n')
    _put(c, f"{prefix}/corpus/more/b.txt", "A paragraph about\nthe hills.\n\nAnother one.\n")
    card = prepare_corpus(DataParams(source="s3", path=f"s3://{BUCKET}/{prefix}/corpus"), tmp_path / "out")
    assert card["passages"] == 4 and card["read"]["files"] == [f"s3://{BUCKET}/{prefix}/corpus"]
    import pyarrow.parquet as pq

    rows = pq.read_table(tmp_path / "out" / "passages.parquet").to_pylist()
    assert {r["text"] for r in rows} == {"The Ardel River flows north.", "Kessaville lies on its bank.",
                                         "A paragraph about the hills.", "Another one."}
    assert {r["doc_id"] for r in rows} >= {"d1", "d2"}


def test_s3_beir_folder_keeps_questions_and_bad_lines_name_the_object(s3, tmp_path):
    server, prefix = s3
    c = server.client()
    root = f"{prefix}/beir"
    _put(c, f"{root}/corpus.jsonl", "".join(json.dumps({"_id": f"d{i}", "title": "", "text": f"passage number {i}"}) + "\n" for i in range(5)))
    _put(c, f"{root}/queries.jsonl", "".join(json.dumps({"_id": f"q{i}", "text": f"which {i}?"}) + "\n" for i in range(5)))
    _put(c, f"{root}/qrels/test.tsv", "query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n" for i in range(5)))
    card = prepare_corpus(DataParams(source="s3", path=f"s3://{BUCKET}/{root}/"), tmp_path / "out")
    assert card["passages"] == 5 and sum(card["queries"].values()) == 5

    _put(c, f"{root}/qrels/test.tsv", "query-id\tcorpus-id\tscore\nq0\td0\t1\nq1\tghost\t1\n")
    with pytest.raises(DataError) as e:
        prepare_corpus(DataParams(source="s3", path=f"s3://{BUCKET}/{root}/"), tmp_path / "out2")
    # the message names the object, not the temp copy that no longer exists
    assert str(e.value).startswith(f"s3://{BUCKET}/{root}/qrels/test.tsv:3: corpus-id 'ghost'"), str(e.value)
    skip = prepare_corpus(DataParams(source="s3", path=f"s3://{BUCKET}/{root}/", on_error="skip"), tmp_path / "out3")
    assert skip["read"]["skipped"] == 1 and skip["read"]["skipped_examples"][0].startswith(f"s3://{BUCKET}/{root}/qrels/test.tsv:3:")


def test_upload_to_a_missing_bucket_is_an_s3error_naming_it(s3, tmp_path):
    server, prefix = s3
    f = tmp_path / "x.txt"
    f.write_text("hello")
    with pytest.raises(S3Error, match=rf"s3://no-such-bucket-{prefix}/k.txt at endpoint {server.url}"):
        s3_upload_file(f, f"s3://no-such-bucket-{prefix}/k.txt")
    with pytest.raises(S3Error, match=rf"s3://no-such-bucket-{prefix}/p"):
        s3_download_prefix(f"s3://no-such-bucket-{prefix}/p", tmp_path / "dl")


# ----------------------------------------------------------------------------------------------
# endpoint down / hanging
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow  # reason: stops and restarts the session's endpoint, which snapshots and restores every object it holds
def test_endpoint_down_fails_in_bounded_time_naming_key_and_endpoint(s3, tmp_path, monkeypatch):
    server, prefix = s3
    _put(server.client(), f"{prefix}/corpus/a.txt", "some text\n")
    f = tmp_path / "model.bin"
    f.write_bytes(os.urandom(4096))
    # Two attempts through the AWS SDKs' own variable, which the stages' clients read: the message and
    # the nothing-written checks do not need the default's five (botocore's jittered backoff of up to
    # 1 + 2 + 4 + 8 s between them: ~20 s per call here), and the variable is the user's knob too.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    with server.stopped():
        t0 = time.monotonic()
        with pytest.raises(S3Error) as e:
            prepare_corpus(DataParams(source="s3", path=f"s3://{BUCKET}/{prefix}/corpus"), tmp_path / "out")
        t_read = time.monotonic() - t0
        assert f"s3://{BUCKET}/{prefix}/corpus" in str(e.value) and server.url in str(e.value)
        assert "Could not connect" in str(e.value)

        t0 = time.monotonic()
        with pytest.raises(S3Error) as e:
            s3_upload_file(f, f"s3://{BUCKET}/{prefix}/up/model.bin")
        t_write = time.monotonic() - t0
        assert f"s3://{BUCKET}/{prefix}/up/model.bin" in str(e.value) and server.url in str(e.value)
    assert t_read < 30 and t_write < 30, (t_read, t_write)
    print(f"\nendpoint down: prepare_corpus failed after {t_read:.1f}s, upload after {t_write:.1f}s")
    assert not (tmp_path / "out").exists()
    assert _keys(server.client(), f"{prefix}/up/") == []  # nothing under the final key


def test_attempts_per_call_default_to_five_and_follow_aws_max_attempts(monkeypatch):
    """Counted as the AWS SDKs count AWS_MAX_ATTEMPTS: the first attempt included."""
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")

    def retries(**kw) -> dict:
        return s3_client("http://127.0.0.1:9", **kw).meta.config.retries

    assert retries() == {"total_max_attempts": 5, "mode": "standard"}  # the first attempt included
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    assert retries()["total_max_attempts"] == 2
    assert retries(max_attempts=3)["total_max_attempts"] == 3  # an explicit argument wins
    for bad in ("two", "0"):
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", bad)
        with pytest.raises(ValueError, match=rf"AWS_MAX_ATTEMPTS='{bad}'.*unset it for 5"):
            s3_client("http://127.0.0.1:9")


def test_hanging_endpoint_times_out_in_bounded_time(tmp_path, monkeypatch):
    """An endpoint that accepts connections and never answers: read_timeout x attempts, not forever."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)  # the kernel completes the handshakes; nobody ever reads or answers
        url = f"http://127.0.0.1:{srv.getsockname()[1]}"
        client = s3_client(url, max_attempts=2, connect_timeout=1, read_timeout=1)
        t0 = time.monotonic()
        with pytest.raises(S3Error, match=rf"s3://{BUCKET}/slow/ at endpoint {url}.*(timeout|Read timed out)"):
            s3_download_prefix(f"s3://{BUCKET}/slow/", tmp_path / "dl", client=client)
        elapsed = time.monotonic() - t0
    assert elapsed < 10, elapsed


# ----------------------------------------------------------------------------------------------
# failed or killed uploads leave nothing under the final key
# ----------------------------------------------------------------------------------------------
MIB = 1024 * 1024


def test_failed_multipart_upload_is_aborted_and_leaves_no_object(s3, tmp_path):
    from botocore.exceptions import ConnectionClosedError

    server, prefix = s3
    f = tmp_path / "big.bin"
    f.write_bytes(os.urandom(9 * MIB))  # over the 8 MiB multipart threshold: two parts
    key = f"{prefix}/big.bin"
    client = s3_client(server.url, max_attempts=2)
    sent = []

    def drop_second_part(request, **_):
        # Inside botocore's retry loop, like a connection that dies while part 2 is on the wire.
        if "partNumber=2" in request.url:
            sent.append(request.url)
            raise ConnectionClosedError(endpoint_url=request.url)

    client.meta.events.register("before-send.s3.UploadPart", drop_second_part)
    with pytest.raises(S3Error, match=rf"s3://{BUCKET}/{key} at endpoint {server.url}"):
        s3_upload_file(f, f"s3://{BUCKET}/{key}", client=client)
    assert len(sent) >= 2  # botocore retried the part (max_attempts=2; s3transfer may add its own) before giving up
    c = server.client()
    assert _keys(c, prefix) == []
    assert not c.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads")  # aborted, no stored parts


_KILLED_UPLOAD = r"""
import sys, time
from pathlib import Path
from components.io import s3_client, s3_upload_file
client = s3_client()
flag = Path(sys.argv[3])
def hang(params, **_):
    if params.get("PartNumber") == 2:
        flag.write_text("part 2 in flight")
        time.sleep(120)
client.meta.events.register("before-parameter-build.s3.UploadPart", hang)
s3_upload_file(sys.argv[1], sys.argv[2], client=client)
"""


def test_upload_killed_mid_way_leaves_no_visible_object(s3, tmp_path):
    server, prefix = s3
    f = tmp_path / "big.bin"
    f.write_bytes(os.urandom(9 * MIB))
    key = f"{prefix}/killed.bin"
    flag = tmp_path / "flag"
    env = {**os.environ, **server.env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_UPLOAD, str(f), f"s3://{BUCKET}/{key}", str(flag)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not flag.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    c = server.client()
    assert _keys(c, prefix) == []  # no object, partial or otherwise, under the final key
    # What a kill does leave: an incomplete multipart upload (invisible, but stored parts) until a
    # lifecycle rule (AbortIncompleteMultipartUpload) or an explicit abort reclaims it.
    uploads = [u for u in c.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", []) if u["Key"] == key]
    assert len(uploads) == 1
    c.abort_multipart_upload(Bucket=BUCKET, Key=key, UploadId=uploads[0]["UploadId"])
