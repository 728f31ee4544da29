"""Submitting at scale: `sdq submit` of N prompts on Postgres and Redis, end to end.

For each size, a prompt file of N distinct prompts (tiny model, so nothing is served from
cache) goes through `sdq submit --json` as a user runs it, in a process of its own; its
wall time and peak resident memory (its VmHWM, polled) are measured. Beside it, the plain way of
putting the same task messages on the broker (Celery's send_task in a loop, no database)
shows how much of the time is the record of truth, and the database's own share: the rows
sdq wrote (jobs, generations, their first history rows) loaded with COPY straight into an
empty copy of the schema, with no Python in the way. The CPU time the submit used, and
that the whole machine used meanwhile (the submit, Postgres and Redis together), say how
far overlapping the work could take it: no way of doing that work finishes in less than
the machine's busy core-seconds over its cores. Prints one JSON object, with each size's
`over_database_floor`: the submit's seconds over the floor's.

    python benchmarks/submit.py [--sizes 10000,100000,500000]
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
import redis
from psycopg.types.json import Jsonb

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sdq.migrations import upgrade  # noqa: E402
from sdq.models.db import make_engine  # noqa: E402
from sdq.models.jobs.kinds import GENERATE  # noqa: E402
from sdq.models.settings import Settings  # noqa: E402
from sdq.workers.app import create_app  # noqa: E402
from tests.services import clean_env, scratch_database, session_redis  # noqa: E402

JOBS_PER_MESSAGE = 32  # sdq's default: batch size 8 x 4 calls per task


def prompt_file(folder: Path, size: int) -> Path:
    path = folder / f"prompts-{size}.csv"
    with path.open("w") as handle:
        handle.write("prompt,seed\n")
        for n in range(size):
            handle.write(f"benchmark {size} subject {n} in a quiet landscape,{n}\n")
    return path


def submit(env: dict[str, str], prompts: Path, folder: Path) -> dict[str, float]:
    output = folder / "submit.json"
    busy_before, children_before = busy_core_seconds(), children_cpu_seconds()
    started = time.perf_counter()
    with output.open("wb") as stdout:
        process = subprocess.Popen(
            [sys.executable, "-m", "sdq.producer.cli", "submit", str(prompts), "--json"],
            env=env,
            cwd=ROOT,
            stdout=stdout,
        )
        peak_kb = 0
        while process.poll() is None:
            peak_kb = max(peak_kb, own_peak_kb(process.pid))
            time.sleep(0.02)  # the wall time is this precise
    seconds = time.perf_counter() - started
    busy = busy_core_seconds() - busy_before
    if process.returncode != 0:
        raise SystemExit(f"sdq submit failed: {output.read_text()}")
    submitted = json.loads(output.read_text())
    jobs = submitted["jobs"]
    return {
        "run_id": submitted["run_id"],
        "jobs": jobs,
        "seconds": round(seconds, 2),
        "jobs_per_second": round(jobs / seconds),
        "peak_mb": round(peak_kb / 1024),
        "cpu_seconds": round(children_cpu_seconds() - children_before, 2),
        "machine_busy_core_seconds": round(busy, 2),
    }


def children_cpu_seconds() -> float:
    """CPU time of this process's children that have ended (the submit, once reaped)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def busy_core_seconds() -> float:
    """CPU time every process on the machine has used since boot, all cores together."""
    # The first line: cpu user nice system idle iowait irq softirq steal ..., in ticks.
    ticks = [int(field) for field in Path("/proc/stat").read_text().split()[1:9]]
    waiting = ticks[3] + ticks[4]  # idle, and idle with I/O outstanding
    return (sum(ticks) - waiting) / os.sysconf("SC_CLK_TCK")


def own_peak_kb(pid: int) -> int:
    """The process's peak resident memory since it started its program (VmHWM). Not
    wait4's ru_maxrss: a child started by vfork, as subprocess does, carries this process's
    peak into its own, so a benchmark that grew would report its size as the child's."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:  # it ended between the poll and the read
        return 0
    return int(status.split("VmHWM:")[1].split()[0]) if "VmHWM:" in status else 0


def plain_send(size: int, broker_url: str) -> float:
    """The same number of messages, sent with Celery alone: no database, no outbox."""
    app = create_app(Settings.from_env({"SDQ_BROKER_URL": broker_url}))
    ids = list(range(size))
    started = time.perf_counter()
    with app.producer_or_acquire() as producer:
        for start in range(0, size, JOBS_PER_MESSAGE):
            app.send_task(
                GENERATE.task_name, args=[ids[start : start + JOBS_PER_MESSAGE]], producer=producer
            )
    return round(time.perf_counter() - started, 2)


RUN_TABLES = {  # what a generation submit writes, and how to find one run's rows in it
    "jobs": "run_id = %(run)s",
    "generations": "job_id IN (SELECT id FROM jobs WHERE run_id = %(run)s)",
    "job_events": "job_id IN (SELECT id FROM jobs WHERE run_id = %(run)s)",
}


def database_floor(source_url: str, run_id: int, folder: Path) -> float:
    """Seconds the database alone takes to load the run's rows, in one transaction, into
    an empty database at the same schema: the floor under any way of submitting them."""
    dumps = {table: folder / f"{table}.copy" for table in RUN_TABLES}
    with psycopg.connect(source_url) as source:
        for table, rows in RUN_TABLES.items():
            query = f"COPY (SELECT * FROM {table} WHERE {rows}) TO STDOUT"
            # Streamed through files: this process stays small, and the next size's submit,
            # which starts as a fork of it, does not report this process's memory as its own.
            with (
                source.cursor().copy(query, {"run": run_id}) as copy,
                dumps[table].open("wb") as out,
            ):
                for data in copy:
                    out.write(data)
        run_row = source.execute("SELECT * FROM runs WHERE id = %s", [run_id]).fetchone()
    with scratch_database("sdq_bench_floor") as target_url:
        upgrade(make_engine(target_url))
        with psycopg.connect(target_url) as target:
            placeholders = ", ".join(["%s"] * len(run_row))
            target.execute(
                f"INSERT INTO runs VALUES ({placeholders})",
                [Jsonb(value) if isinstance(value, dict) else value for value in run_row],
            )
            target.commit()
            started = time.perf_counter()
            for table, dump in dumps.items():
                with (
                    target.cursor().copy(f"COPY {table} FROM STDIN") as copy,
                    dump.open("rb") as rows,
                ):
                    while data := rows.read(1 << 20):
                        copy.write(data)
            target.commit()
            return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,500000")
    sizes = [int(size) for size in parser.parse_args().sizes.split(",")]
    results = {}
    with (
        session_redis() as redis_port,
        scratch_database("sdq_bench") as database_url,
        tempfile.TemporaryDirectory() as folder,
    ):
        broker_url = f"redis://127.0.0.1:{redis_port}/0"
        broker = redis.Redis.from_url(broker_url)
        upgrade(make_engine(database_url))
        env = {
            **clean_env(),
            "SDQ_DATABASE_URL": database_url,
            "SDQ_BROKER_URL": broker_url,
            "SDQ_STORE_URL": str(Path(folder) / "store"),
        }
        for size in sizes:
            prompts = prompt_file(Path(folder), size)
            broker.flushdb()
            measured = submit(env, prompts, Path(folder))
            floor = database_floor(database_url, measured.pop("run_id"), Path(folder))
            measured["database_floor_seconds"] = round(floor, 2)
            # The goal: a submit within 1.5x of its rows' own loading time.
            measured["over_database_floor"] = round(measured["seconds"] / floor, 2)
            broker.flushdb()
            measured["plain_send_seconds"] = plain_send(size, broker_url)
            results[str(size)] = measured
    print(json.dumps({"cores": os.cpu_count(), "submit": results}, indent=2))


if __name__ == "__main__":
    main()
