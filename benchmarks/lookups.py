"""Lookups at a million jobs: sdq's indexes against the same table scanned without them.

Fills a fresh database (built by the migrations) with --jobs generation jobs in --runs runs
using Postgres' generate_series, then times the lookups `sdq` and its users make, once as
the planner likes (sdq's indexes) and once with index scans turned off (the plain table).
Prints one JSON object with milliseconds per lookup and the speed-up of each.

    python benchmarks/lookups.py [--jobs 1000000] [--runs 1000] [--repeat 5]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sdq.migrations import upgrade  # noqa: E402
from sdq.models.db import make_engine  # noqa: E402
from tests.services import scratch_database  # noqa: E402

WORDS = "castle fox lighthouse library boat village robot garden pond caravan owl teapot"

FILL = [
    """
INSERT INTO runs (kind, source, options, job_count)
SELECT 'generate', 'bench.csv', '{}'::jsonb, %(per_run)s FROM generate_series(1, %(runs)s)
""",
    """
INSERT INTO jobs (run_id, kind, spec, spec_hash, status, attempts, cached, created_at)
SELECT 1 + (n %% %(runs)s), 'generate',
       jsonb_build_object('seed', n, 'steps', 25),
       md5(n::text) || md5((n + 1)::text),
       CASE WHEN n %% 1000 = 0 THEN 'queued' WHEN n %% 997 = 0 THEN 'dead' ELSE 'succeeded' END,
       1, false, now()
FROM generate_series(1, %(jobs)s) AS n
""",
    """
INSERT INTO generations (job_id, prompt, style, model, seed, batch_key)
SELECT id, (string_to_array(%(words)s, ' '))[1 + id %% 12] || ' number ' || id || ' at dusk',
       (ARRAY['ink', 'oil', 'pixel art'])[1 + id %% 3], 'tiny', id, md5((id %% 97)::text)
FROM jobs
""",
    "ANALYZE",
]

LOOKUPS = {
    "status of a run (counts by status)": (
        "SELECT status, count(*) FROM jobs WHERE run_id = 417 GROUP BY status"
    ),
    "find by prompt text (ILIKE)": (
        "SELECT job_id FROM generations WHERE prompt ILIKE '%%number 123456 %%' "
        "ORDER BY job_id DESC LIMIT 50"
    ),
    "rendered before? (spec hash)": (
        "SELECT output_uri FROM jobs WHERE spec_hash = md5('777777') || md5('777778') "
        "AND status = 'succeeded'"
    ),
    "job by spec-hash prefix (sdq show 3fa9c1)": (
        "SELECT DISTINCT spec_hash FROM jobs WHERE spec_hash LIKE left(md5('777777'), 8) || '%%' "
        "LIMIT 2"
    ),
    "unfinished jobs (relay, lease sweep)": (
        "SELECT id FROM jobs WHERE status NOT IN ('succeeded', 'dead', 'cancelled') "
        "AND lease_expires_at IS NULL LIMIT 1000"
    ),
    "dead jobs of a run": "SELECT id FROM jobs WHERE run_id = 418 AND status = 'dead'",
}
WITHOUT_INDEXES = ("enable_indexscan", "enable_bitmapscan", "enable_indexonlyscan")


def milliseconds(connection: psycopg.Connection, query: str, repeat: int) -> float:
    timings = []
    for _ in range(repeat):
        started = time.perf_counter()
        connection.execute(query).fetchall()
        timings.append((time.perf_counter() - started) * 1000)
    return statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with scratch_database("sdq_lookups") as url:
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        with psycopg.connect(url, autocommit=True) as connection:
            started = time.perf_counter()
            parameters = {"jobs": args.jobs, "runs": args.runs, "words": WORDS}
            for statement in FILL:
                connection.execute(statement, {**parameters, "per_run": args.jobs // args.runs})
            fill_seconds = time.perf_counter() - started
            indexed = {
                name: milliseconds(connection, sql, args.repeat) for name, sql in LOOKUPS.items()
            }
            for setting in WITHOUT_INDEXES:
                connection.execute(f"SET {setting} = off")
            plain = {
                name: milliseconds(connection, sql, args.repeat) for name, sql in LOOKUPS.items()
            }
    print(
        json.dumps(
            {
                "jobs": args.jobs,
                "runs": args.runs,
                "fill_seconds": round(fill_seconds, 1),
                "lookups_ms": {
                    name: {
                        "sdq": round(indexed[name], 2),
                        "without_indexes": round(plain[name], 2),
                        "speedup": round(plain[name] / indexed[name], 1),
                    }
                    for name in LOOKUPS
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
