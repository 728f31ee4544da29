"""The object store on a local folder and on a real S3 API over HTTP."""

import json
import os
import subprocess
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psycopg
import pytest

from sdq.models.store import (
    LARGE_PART,
    LocalStore,
    MissingBucket,
    MissingObject,
    S3Store,
    StoreError,
    StoreUnavailable,
    open_store,
)
from tests.conftest import BUCKET, ROOT, run_sdq
from tests.services import aws_env, free_port


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path: Path, monkeypatch):
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    for key, value in request.getfixturevalue("s3").items():
        monkeypatch.setenv(key, value)
    return S3Store(BUCKET, f"store-test/{tmp_path.name}")


def test_round_trip(store, tmp_path: Path) -> None:
    uri = store.put_bytes("images/a.png", b"png-bytes", content_type="image/png")
    assert uri == store.uri("images/a.png")
    assert store.get_bytes("images/a.png") == b"png-bytes"
    assert store.exists("images/a.png") and not store.exists("images/b.png")
    source = tmp_path / "weights.bin"
    source.write_bytes(b"w" * 100_000)
    store.put_file("models/m/unet/weights.bin", source)
    store.get_file("models/m/unet/weights.bin", tmp_path / "copy" / "weights.bin")
    assert (tmp_path / "copy" / "weights.bin").read_bytes() == source.read_bytes()
    assert sorted(store.list_keys("models/m/")) == ["models/m/unet/weights.bin"]
    assert store.copy("models/m/unet/weights.bin", "models/n/unet/weights.bin") == store.uri(
        "models/n/unet/weights.bin"
    )
    assert store.get_bytes("models/n/unet/weights.bin") == source.read_bytes()
    with pytest.raises(MissingObject):
        store.get_bytes("images/missing.png")
    with pytest.raises(MissingObject):
        store.copy("images/missing.png", "images/copy.png")
    assert not store.exists("images/copy.png")


def test_a_large_object_reads_whole_and_from_s3_in_parallel_ranged_parts(store) -> None:
    data = os.urandom(LARGE_PART * 2 + 12345)
    store.put_bytes("latents/big.parquet", data, content_type="application/octet-stream")
    ranges: list[str] = []
    if isinstance(store, S3Store):
        store._client.meta.events.register(
            "before-call.s3.GetObject",
            lambda params, **_: ranges.append(params.get("headers", {}).get("Range", "")),
        )
    assert bytes(store.get_large("latents/big.parquet")) == data
    if isinstance(store, S3Store):
        assert len(ranges) == 3 and all(part.startswith("bytes=") for part in ranges)
    with pytest.raises(MissingObject):
        store.get_large("latents/missing.parquet")


def test_overwrite_is_never_seen_half_written(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    old, new = b"a" * 4_000_000, b"b" * 4_000_000
    store.put_bytes("k", old, content_type="application/octet-stream")
    seen: set[bytes] = set()
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            data = store.get_bytes("k")
            seen.add(data[:1] + data[-1:] + bytes([len(data) == 4_000_000]))

    reader = threading.Thread(target=read)
    reader.start()
    for _ in range(20):
        store.put_bytes("k", new, content_type="application/octet-stream")
        store.put_bytes("k", old, content_type="application/octet-stream")
    stop.set()
    reader.join()
    assert seen <= {b"aa\x01", b"bb\x01"}
    assert [path.name for path in tmp_path.iterdir()] == ["k"], "no temporary file is left"


def test_a_failed_write_leaves_nothing(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    unreadable = tmp_path / "a-directory"
    unreadable.mkdir()
    with pytest.raises(IsADirectoryError):
        store.put_file("images/k.png", unreadable)
    assert list((tmp_path / "store" / "images").iterdir()) == []


def test_local_files_get_the_mode_the_umask_gives(tmp_path: Path) -> None:
    """Not mkstemp's private 0600: a web server or another user can read what is written."""
    # In a process of its own: the store reads the umask once, when it is imported.
    script = (
        "import os, stat, sys\n"
        "from pathlib import Path\n"
        "os.umask(0o022)\n"
        "from sdq.models.store import LocalStore\n"
        "root = Path(sys.argv[1])\n"
        "LocalStore(root).put_bytes('a/b.png', b'x', content_type='image/png')\n"
        "print(oct(stat.S_IMODE((root / 'a/b.png').stat().st_mode)))\n"
    )
    check = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "store")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert check.stdout.strip() == "0o644"


def test_keys_cannot_escape_a_local_store(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="escapes"):
        LocalStore(tmp_path / "root").put_bytes("../x", b"", content_type="text/plain")


def test_missing_bucket_is_named(s3, monkeypatch, tmp_path: Path) -> None:
    for key, value in s3.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(StoreError, match="bucket 'no-such-bucket' does not exist"):
        S3Store("no-such-bucket").put_bytes("k", b"x", content_type="text/plain")
    with pytest.raises(StoreError, match="does not exist"):
        S3Store("no-such-bucket").check()
    # A download starts with a HEAD, whose bare 404 could be a key's: the bucket is asked.
    with pytest.raises(MissingBucket, match="bucket 'no-such-bucket' does not exist"):
        S3Store("no-such-bucket").get_file("k", tmp_path / "k")
    with pytest.raises(MissingObject):
        S3Store(BUCKET).get_file("no/such/key", tmp_path / "k")


def test_db_upgrade_makes_a_missing_bucket_and_every_command_names_it(
    s3, own_deployment: dict[str, str], s3_client
) -> None:
    """A new deployment's first hour: its bucket does not exist yet. (A database of its
    own: `sdq db upgrade` records the store in it, which the other tests' is not.)"""
    bucket = f"fresh-{uuid.uuid4().hex[:12]}"
    env = {**own_deployment, "SDQ_STORE_URL": f"s3://{bucket}/sdq"}

    def sdq(*args: str) -> subprocess.CompletedProcess:
        return run_sdq(env, *args, cwd=ROOT)

    def runs() -> int:
        with psycopg.connect(env["SDQ_DATABASE_URL"]) as connection:
            return connection.execute("SELECT count(*) FROM runs").fetchone()[0]

    before = runs()
    prompts = str(ROOT / "examples" / "subjects.csv")
    for command in (
        ["submit", prompts],
        ["download", prompts, "--dataset", "nowhere", "--url-col", "prompt"],
        ["encode", "nowhere", "--model", "tiny"],
        ["train", "nowhere", "--base", "tiny", "--steps", "4"],
    ):
        missing = sdq(*command)
        said = " ".join(missing.stderr.split())
        assert missing.returncode == 2, (command, missing.stderr)
        assert f"bucket '{bucket}' does not exist" in said, command
        assert "`sdq db upgrade` makes it" in said and "Traceback" not in said, command
    assert runs() == before  # nothing was queued
    first = sdq("db", "upgrade", "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["store_created"] is True
    assert bucket in [found["Name"] for found in s3_client.list_buckets()["Buckets"]]
    again = sdq("db", "upgrade", "--json")
    assert json.loads(again.stdout)["store_created"] is False


def test_rejected_credentials_are_named(monkeypatch) -> None:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port())
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{server._port}"
        for key, value in aws_env(endpoint).items():
            monkeypatch.setenv(key, value)
        # moto checks signatures only when told to; it then knows no access key "testing".
        monkeypatch.setattr("moto.settings.INITIAL_NO_AUTH_ACTION_COUNT", 0)
        with pytest.raises(StoreError, match="rejected the credentials"):
            S3Store("any-bucket").put_bytes("k", b"x", content_type="text/plain")
    finally:
        server.stop()


def test_unreachable_endpoint_is_retryable(monkeypatch) -> None:
    for key, value in aws_env(f"http://127.0.0.1:{free_port()}").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(StoreUnavailable, match="cannot reach"):
        S3Store(BUCKET).put_bytes("k", b"x", content_type="text/plain")


class Unavailable(BaseHTTPRequestHandler):
    """An S3 endpoint in an outage: every request answered 503 SlowDown."""

    def _refuse(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b"<Error><Code>ServiceUnavailable</Code><Message>down</Message></Error>"
        self.send_response(503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_PUT = do_GET = do_POST = do_HEAD = _refuse

    def log_message(self, *args) -> None:
        pass


def test_an_outage_during_a_file_upload_is_an_outage(tmp_path: Path, monkeypatch) -> None:
    # boto3 wraps a file upload's error response in an error of its own (S3UploadFailedError):
    # a checkpoint's upload during an outage must be retried as one, not spend an attempt.
    server = ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for key, value in aws_env(f"http://127.0.0.1:{server.server_port}").items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        source = tmp_path / "training.safetensors"
        source.write_bytes(b"state" * 1000)
        with pytest.raises(StoreUnavailable, match="failed on s3://sdq-test/k: ServiceUnavailable"):
            S3Store(BUCKET).put_file("k", source)
        with pytest.raises(StoreUnavailable, match="failed on"):
            S3Store(BUCKET).put_bytes("k", b"x", content_type="text/plain")
    finally:
        server.shutdown()


def test_store_urls(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert isinstance(open_store(tmp_path.as_uri()), LocalStore)
    s3 = open_store("s3://bucket/some/prefix")
    assert (
        isinstance(s3, S3Store) and s3.uri("images/x.png") == "s3://bucket/some/prefix/images/x.png"
    )
    with pytest.raises(StoreError, match="unsupported"):
        open_store("ftp://host/x")
