import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner, Result

from sdq.models.db import make_engine
from sdq.producer.cli.main import main
from tests.netns_download import DOWNLOAD_ENV
from tests.preloaded import ROOT, preloaded
from tests.services import (
    MotoServer,
    OutageProxy,
    aws_env,
    clean_env,
    scratch_database,
    session_redis,
    wait_for,
)
from tests.services import s3_client as s3_client_for

BUCKET = "sdq-test"

# A shell without job control starts a background command with SIGINT ignored, and every
# command the tests start would inherit that: the tests that press Ctrl-C need it heard.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: a test process per core and one more. A test spends part of its time
    waiting on processes of its own (a worker's start, a lease running out, a killed process
    started again); with one process per core the cores stood idle 16% of the suite's time,
    with one more they are busy to the end (448 tests on 2 cores: 1,384 s against 1,258 s
    and 1,346 s)."""
    return len(os.sched_getaffinity(0)) + 1


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests first, in their order, then the rest: in a parallel run, the last
    tests to start are short ones that share the processes out evenly, not a slow one that
    holds the run up while the other processes sit idle (a two-node run that started 801 s
    in kept one process busy for 78 s after the other two were done; 450 tests on 2 cores:
    1,103 s, then 990 s so)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A database of its own for this test session, dropped at the end."""
    with scratch_database("sdq_test") as url:
        yield url


@pytest.fixture(scope="session")
def migrated_postgres(postgres_url: str) -> str:
    from sdq.migrations import upgrade

    upgrade(make_engine(postgres_url))
    return postgres_url


@pytest.fixture(scope="session")
def redis_port() -> Iterator[int]:
    """The session's own Redis server (services.session_redis)."""
    with session_redis() as port:
        yield port


@pytest.fixture(scope="session")
def redis_url(redis_port: int) -> str:
    return f"redis://127.0.0.1:{redis_port}/11"


@pytest.fixture(scope="session")
def s3() -> Iterator[dict[str, str]]:
    """An S3 endpoint over HTTP with an empty bucket; yields the AWS_* variables for it."""
    server = MotoServer().start()
    s3_client_for(server.endpoint).create_bucket(Bucket=BUCKET)
    yield aws_env(server.endpoint)
    server.stop()


@pytest.fixture(scope="session")
def s3_client(s3: dict[str, str]):
    return s3_client_for(s3["AWS_ENDPOINT_URL"])


@pytest.fixture(scope="session")
def service_env(
    migrated_postgres: str, redis_url: str, s3: dict[str, str], tmp_path_factory
) -> dict[str, str]:
    """What a deployment sets: Postgres, Redis and S3, and nothing from the developer's shell."""
    home = tmp_path_factory.mktemp("sdq-home")
    return {
        **clean_env(),
        **s3,
        "SDQ_DATABASE_URL": migrated_postgres,
        "SDQ_BROKER_URL": redis_url,
        "SDQ_STORE_URL": f"s3://{BUCKET}/deployment",
        "SDQ_HOME": str(home),
        "SDQ_MODEL_CACHE": str(home / "model-cache"),
        "SDQ_LEASE_SECONDS": "6",
        "SDQ_RETRY_BACKOFF_SECONDS": "1",
    }


class WorkerProcess:
    """`sdq worker gpu` (or `cpu`) as a user starts it, in a process group of its own; on a
    `host` name of its own (a UTS namespace), as if on a machine of its own, where given:
    its Celery node is then NAME@host, its jobs' worker host:pid."""

    # What the log says once the process is ready, and how long it may take to: a net for
    # one that hangs (one that dies fails at once), wide enough for a loaded machine.
    READY = "ready."
    READY_SECONDS = 180

    def __init__(
        self,
        env: dict[str, str],
        log: Path,
        pool: str = "gpu",
        args: tuple[str, ...] = (),
        host: str | None = None,
    ) -> None:
        self.env, self.log, self.pool, self.args, self.host = env, log, pool, args, host
        self.process: subprocess.Popen | None = None

    @property
    def command(self) -> list[str]:
        return ["worker", self.pool, *self.args]

    def start(self) -> "WorkerProcess":
        named = ["unshare", "-u", "sh", "-c", f'hostname {self.host} && exec "$@"', "sh"]
        self.process = subprocess.Popen(
            [
                *(named if self.host else []),
                sys.executable,
                "-m",
                "sdq.producer.cli",
                *self.command,
                "--loglevel",
                "info",
            ],
            env=self.env,
            cwd=ROOT,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_for(self.ready, what=f"worker (log: {self.log})", timeout=self.READY_SECONDS)
        return self

    def ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"worker exited: {self.log.read_text()[-3000:]}")
        return self.READY in self.log.read_text()

    def children(self) -> list[int]:
        """Pids of the prefork pool processes that run the tasks."""
        output = subprocess.run(
            ["pgrep", "-g", str(self.process.pid)], capture_output=True, text=True
        ).stdout
        return [int(pid) for pid in output.split()]

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait()


class BeatProcess(WorkerProcess):
    """`sdq beat`, as a user starts it."""

    READY = "beat: Starting"

    @property
    def command(self) -> list[str]:
        return ["beat"]


@pytest.fixture(scope="session")
def worker(service_env: dict[str, str], tmp_path_factory) -> Iterator[WorkerProcess]:
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    process = WorkerProcess(service_env, log).start()
    yield process
    process.stop()


@pytest.fixture
def own_deployment(service_env: dict[str, str], redis_port: int) -> Iterator[dict[str, str]]:
    """The deployment with a database and a broker of this test's own: what it counts (every
    job, every tick of beat) is its own, and the session's worker takes none of its jobs."""
    import redis

    from sdq.migrations import upgrade

    broker = f"redis://127.0.0.1:{redis_port}/9"
    redis.Redis.from_url(broker).flushdb()
    with scratch_database("sdq_own") as database_url:
        upgrade(make_engine(database_url))
        yield {**service_env, "SDQ_BROKER_URL": broker, "SDQ_DATABASE_URL": database_url}


@pytest.fixture
def download_env(service_env: dict[str, str]) -> dict[str, str]:
    """The deployment, with the test image server's address allowed."""
    return {**service_env, **DOWNLOAD_ENV}


@pytest.fixture
def cpu_worker(download_env: dict[str, str], tmp_path: Path) -> Iterator[WorkerProcess]:
    worker = WorkerProcess(download_env, tmp_path / "cpu-worker.log", pool="cpu").start()
    yield worker
    worker.stop()


@pytest.fixture
def sdq(service_env: dict[str, str]):
    """Runs the sdq CLI in this process against the test deployment."""

    def run(*args: str, env: dict[str, str] | None = None) -> Result:
        return CliRunner().invoke(
            main,
            list(args),
            env={**service_env, **(env or {})},
            catch_exceptions=False,
        )

    return run


def run_sdq(
    env: dict[str, str], *args: str, cwd: Path = ROOT, timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs an sdq command as a user does, in a process of its own (tests/preloaded.py), and
    gives what it printed, as subprocess.run(..., capture_output=True, text=True) would."""
    return preloaded().run(list(args), env=env, cwd=cwd, timeout=timeout)


def sdq_json(
    env: dict[str, str], *args: str, cwd: Path = ROOT, timeout: float = 240, exit_code: int = 0
) -> dict:
    """Runs an sdq command as a user does (run_sdq) and reads its JSON (printed also when it
    fails, with `exit_code`)."""
    result = run_sdq(env, *args, "--json", cwd=cwd, timeout=timeout)
    assert result.returncode == exit_code, result.stderr[-3000:]
    return json.loads(result.stdout)


def wait_for_run(database_url: str, run_id: int, timeout: float = 240) -> dict[str, int]:
    """Waits until the run is finished; returns its jobs counted by status."""

    def finished() -> bool:
        with psycopg.connect(database_url) as connection:
            [done] = connection.execute(
                "SELECT finished_at IS NOT NULL FROM runs WHERE id = %s", (run_id,)
            ).fetchone()
        return done

    wait_for(finished, what=f"run {run_id} to finish", timeout=timeout)
    with psycopg.connect(database_url) as connection:
        return dict(
            connection.execute(
                "SELECT status, count(*) FROM jobs WHERE run_id = %s GROUP BY status", (run_id,)
            ).fetchall()
        )


def write(path: Path, text: str, encoding: str = "utf-8") -> Path:
    path.write_bytes(text.encode(encoding))
    return path


def job_history(database_url: str, run_id: int) -> list[tuple[int, str, str | None, int]]:
    """The run's job events in order: each one's job, status, detail and the job's attempts."""
    with psycopg.connect(database_url) as connection:
        return connection.execute(
            "SELECT e.job_id, e.status, e.detail, j.attempts FROM job_events e "
            "JOIN jobs j ON j.id = e.job_id WHERE j.run_id = %s ORDER BY e.id",
            (run_id,),
        ).fetchall()


@contextmanager
def store_behind_a_proxy(
    deployment: dict[str, str], s3: dict[str, str], prefix: str
) -> Iterator[tuple[dict[str, str], OutageProxy]]:
    """A deployment whose S3 server is reached through a proxy the test takes down and
    brings back, with short leases, maintenance every second and quick retries: what the
    fault tests wait through in seconds."""
    upstream = int(s3["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    with OutageProxy(upstream) as proxy:
        yield {**deployment, **DOWNLOAD_ENV, "SDQ_STORE_URL": f"s3://{BUCKET}/{prefix}",
               "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}", "SDQ_LEASE_SECONDS": "6",
               "SDQ_MAINTENANCE_INTERVAL_SECONDS": "1", "SDQ_RETRY_BACKOFF_SECONDS": "1",
               "SDQ_RETRY_BACKOFF_MAX_SECONDS": "3"}, proxy  # fmt: skip
