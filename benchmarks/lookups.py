"""Lookups at a million jobs: sdq's indexes against the same table scanned without them.

Fills a fresh database (built by the migrations) with --jobs generation jobs in --runs runs,
specs of a real job's size and three history events each, using Postgres' generate_series,
then times the lookups `sdq` and its users make, once as the planner likes (sdq's indexes)
and once with index scans turned off (the plain table).
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
# What a Stable Diffusion job's spec holds besides its seed: a table of real size, not a
# small one that any scan reads fast.
SPEC = {
    "dtype": "float16",
    "steps": 25,
    "width": 512,
    "height": 512,
    "prompt": "a lighthouse on a cliff at dusk, oil painting, dramatic light, highly detailed",
    "guidance": 7.5,
    "scheduler": "EulerDiscreteScheduler",
    "model_name": "sd15",
    "model_source": "hub:stable-diffusion-v1-5/stable-diffusion-v1-5",
    "model_revision": "451f4fe16113bff5a5d2269ed5ad43b0592e9a14",
    "negative_prompt": "blurry, low quality",
    "scheduler_config": {
        "beta_end": 0.012,
        "beta_start": 0.00085,
        "steps_offset": 1,
        "beta_schedule": "scaled_linear",
        "prediction_type": "epsilon",
        "timestep_spacing": "leading",
        "num_train_timesteps": 1000,
    },
}

FILL = [
    """
INSERT INTO runs (kind, source, options, job_count)
SELECT 'generate', 'bench.csv', '{}'::jsonb, %(per_run)s FROM generate_series(1, %(runs)s)
""",
    """
INSERT INTO jobs (run_id, kind, spec, spec_hash, status, attempts, cached, created_at)
SELECT 1 + (n %% %(runs)s), 'generate',
       %(spec)s::jsonb || jsonb_build_object('seed', n),
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
    # Each job's history: queued, running, and how it ended (one in 101 failed instead).
    """
INSERT INTO job_events (job_id, status, at)
SELECT id, event.status, created_at + event.after * interval '1 second'
FROM jobs, LATERAL (VALUES ('queued', 0), ('running', 1),
    (CASE WHEN id %% 101 = 0 THEN 'failed' ELSE jobs.status END, 2)) AS event(status, after)
""",
    "VACUUM ANALYZE",
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
    "jobs by kind and status (each metrics scrape)": (
        "SELECT kind, status, count(*) FROM jobs GROUP BY kind, status"
    ),
    "failures in the last day (rollups, metrics)": (
        "SELECT count(*) FROM job_events WHERE status IN ('failed', 'dead') "
        "AND at >= now() - interval '1 day'"
    ),
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
            parameters = {
                "jobs": args.jobs,
                "runs": args.runs,
                "words": WORDS,
                "spec": json.dumps(SPEC),
            }
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
