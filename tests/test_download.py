"""sdq download end to end: hostile URLs against the real pipeline, in a loopback-only
network namespace (embedded) and on the services with a real CPU worker process."""

import io
import json
import subprocess
import sys
from pathlib import Path

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import BUCKET, ROOT, WorkerProcess, run_sdq, sdq_json
from tests.hostile_server import CASES, HostileServer, case_rows, many_pixels
from tests.netns_download import write_list

pytestmark = pytest.mark.timeout(300)


def expected_reason(row: dict, first_key: str) -> str | None:
    return row["reason"].format(photo=first_key) if row["reason"] else None


def check_rows(expected: list[dict], got: list[dict], reason_field: str) -> None:
    """Each list row ends with its case's status and reason, in list order."""
    first_key = got[0]["key"]  # /photo.jpg comes first: it keeps the picture
    assert [(row["status"], row[reason_field]) for row in got] == [
        (row["status"], expected_reason(row, first_key)) for row in expected
    ]


def test_hostile_inputs_end_with_their_reason_where_only_loopback_exists(tmp_path: Path) -> None:
    """Every hostile case, blocked addresses off the machine included, through `sdq
    download` (embedded): a broken refusal finds no network to reach."""
    script = f"ip link set lo up && exec {sys.executable} -m tests.netns_download {tmp_path}"
    result = subprocess.run(
        ["unshare", "-n", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    check_rows(report["expected"], report["sql"], "reason")
    check_rows(report["expected"], report["shard"], "error_message")
    for row in report["shard"]:
        assert row["has_image"] == (row["status"] == "success")
        if row["status"] == "success":
            assert (row["width"], row["height"]) == (256, 256)
            assert len(row["sha256"]) == 64


def _samples(database_url: str, dataset: str) -> list[tuple]:
    with psycopg.connect(database_url) as connection:
        return connection.execute(
            "SELECT s.key, s.status, s.reason, s.url, h.number FROM samples s "
            "JOIN datasets d ON d.id = s.dataset_id JOIN shards h ON h.id = s.shard_id "
            "WHERE d.name = %s ORDER BY s.key",
            (dataset,),
        ).fetchall()


def _shard(s3_client, summary: dict, number: int) -> pa.Table:
    """A shard file, read from S3 where `sdq dataset show` says it is."""
    uri = summary["shards"][number]["uri"]
    assert uri.startswith(f"s3://{BUCKET}/")
    body = s3_client.get_object(Bucket=BUCKET, Key=uri.removeprefix(f"s3://{BUCKET}/"))
    return pq.read_table(io.BytesIO(body["Body"].read()))


def test_download_on_services_records_every_row_in_sql_and_shards(
    download_env: dict[str, str], cpu_worker: WorkerProcess, s3_client, tmp_path: Path
) -> None:
    # The setting that opens private networks is the workers': one set in the submitting
    # shell opens nothing, and the hint says where it counts and what the workers had.
    submitting = {**download_env, "SDQ_DOWNLOAD_ALLOW_NETWORKS": "10.0.0.0/8"}
    with HostileServer() as server:
        expected = case_rows(server.base, server.port, CASES)
        write_list(tmp_path / "hostile.csv", expected)
        done = run_sdq(submitting, "download", "--wait", "--json", str(tmp_path / "hostile.csv"),
                       "--dataset", "web", timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["blocked_by"] == ["127.0.0.1/32"]
    hint = " ".join(done.stderr.split())
    assert "it opened 127.0.0.1/32 on the CPU workers that fetched them" in hint
    assert "where the CPU workers run (`sdq worker cpu`) and restart them" in hint
    samples = _samples(download_env["SDQ_DATABASE_URL"], "web")
    check_rows(
        expected,
        [{"key": key, "status": status, "reason": reason} for key, status, reason, *_ in samples],
        "reason",
    )
    shard = _shard(s3_client, summary, 0).to_pylist()
    assert [row["key"] for row in shard] == [row[0] for row in samples]
    assert [row["status"] for row in shard] == [row[1] for row in samples]
    assert summary["name"] == "web"
    assert summary["samples"] == len(CASES)
    assert summary["by_status"] == {
        status: sum(row["status"] == status for row in expected)
        for status in ("success", "duplicate", "failed")
    }
    assert summary["reasons"]["blocked address"] == 2
    assert [(shard["rows"], shard["ok"]) for shard in summary["shards"]] == [
        (len(CASES), summary["by_status"]["success"])
    ]
    assert summary["shards"][0]["uri"].endswith("/datasets/web/images/00000.parquet")


def laion_parquet(path: Path, base: str, rows: int) -> Path:
    """A list in LAION's own column names, with a column to carry into the shards."""
    table = pa.table(
        {
            # Row 3 repeats row 2's URL.
            "URL": [f"{base}/img/{n - (n == 3)}.jpg" for n in range(rows)],
            "TEXT": [f"photo number {n}" for n in range(rows)],
            "similarity": [0.3 + n / 100 for n in range(rows)],
        }
    )
    pq.write_table(table, path, row_group_size=3)
    return path


def test_laion_parquet_is_sliced_into_shards_resumed_and_redone_once(
    download_env: dict[str, str], cpu_worker: WorkerProcess, s3_client, tmp_path: Path
) -> None:
    """Ten rows, four per shard: three download jobs. Running it again does nothing; a
    slice whose job is sent again (as after a killed worker) leaves one set of rows."""
    database_url = download_env["SDQ_DATABASE_URL"]
    with HostileServer() as server:
        listing = str(laion_parquet(tmp_path / "part-00000.parquet", server.base, 10))
        args = [
            listing, "--dataset", "laion", "--url-col", "URL", "--caption-col", "TEXT",
            "--rows-per-shard", "4", "--save-columns", "similarity", "--format", "webp",
        ]  # fmt: skip
        first = sdq_json(download_env, "download", "--wait", *args)
        samples = _samples(database_url, "laion")
        assert [number for *_, number in samples] == [0] * 4 + [1] * 4 + [2] * 2
        assert [(status, reason) for _, status, reason, *_ in samples] == [
            ("success", None)
        ] * 3 + [("duplicate", "duplicate of 000002")] + [("success", None)] * 6
        shard = _shard(s3_client, first, 1)
        assert shard.column("similarity").to_pylist() == pytest.approx([0.34, 0.35, 0.36, 0.37])
        assert [image[:4] for image in shard.column("webp").to_pylist()] == [b"RIFF"] * 4

        again = sdq_json(download_env, "download", "--wait", *args)
        assert again["shards"] == first["shards"]
        assert _samples(database_url, "laion") == samples
        # A dataset's shards are cut alike: other options are refused in their flags' names.
        other = run_sdq(download_env, "download", *args[:7], "--format", "png", cwd=ROOT)
        said = " ".join(other.stderr.split())
        made_with = "dataset 'laion' was made with --format webp, --rows-per-shard 4: give"
        assert other.returncode == 2 and made_with in said, said
        with psycopg.connect(database_url) as connection:
            run_id, cached = connection.execute(
                "SELECT run_id, bool_and(cached) FROM jobs WHERE kind = 'download' "
                "GROUP BY run_id ORDER BY run_id DESC LIMIT 1"
            ).fetchone()
            assert cached
            # As the lease sweep leaves a killed worker's job: claimable, its work redone.
            connection.execute(
                "UPDATE jobs SET status = 'queued', cached = false WHERE run_id = %s "
                "AND spec->>'shard' = '1'",
                (run_id,),
            )
        requeue = run_sdq(download_env, "requeue", str(run_id), cwd=ROOT)
        assert requeue.returncode == 0, requeue.stderr
        _wait_finished(database_url, run_id)
    assert _samples(database_url, "laion") == samples


def _wait_finished(database_url: str, run_id: int) -> None:
    from tests.services import wait_for

    def finished() -> bool:
        with psycopg.connect(database_url) as connection:
            return not connection.execute(
                "SELECT count(*) FROM jobs WHERE run_id = %s AND status NOT IN "
                "('succeeded', 'dead', 'cancelled')",
                (run_id,),
            ).fetchone()[0]

    wait_for(finished, what=f"run {run_id} to finish", timeout=120)


def test_a_list_without_the_named_column_is_refused_by_name(
    download_env: dict[str, str], tmp_path: Path
) -> None:
    listing = tmp_path / "list.tsv"
    listing.write_text("URL\tTEXT\nhttp://example.invalid/a.jpg\ta cat\n")
    result = run_sdq(download_env, "download", str(listing), "--dataset", "x", cwd=ROOT)
    assert result.returncode == 2
    assert f"{listing}: no column 'url' (it has URL, TEXT); did you mean 'URL'?" in result.stderr
    with psycopg.connect(download_env["SDQ_DATABASE_URL"]) as connection:
        assert not connection.execute("SELECT 1 FROM datasets WHERE name = 'x'").fetchone()


def peak_rss(worker: WorkerProcess) -> int:
    """The highest resident memory any of the worker's processes has had, in bytes."""
    peaks = []
    for pid in worker.children():
        status = Path(f"/proc/{pid}/status").read_text()
        [kilobytes] = [line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")]
        peaks.append(int(kilobytes) * 1024)
    return max(peaks)


@pytest.mark.slow
def test_huge_images_take_a_worker_s_memory_in_turns(
    download_env: dict[str, str], tmp_path: Path
) -> None:
    """Eight threads, eight 80-megapixel PNGs of 1 MB each: decoded at once they would
    hold 1.9 GB of RGB. With a budget of one such image they take their turns, and the
    worker's peak grows by one image's pixels and a working copy at most."""
    budget = 80_000_000
    env = {**download_env, "SDQ_DOWNLOAD_THREADS": "8", "SDQ_DOWNLOAD_MAX_BYTES": "2000000",
           "SDQ_DOWNLOAD_MAX_PIXELS": str(budget),
           "SDQ_DOWNLOAD_PIXEL_BUDGET": str(budget)}  # fmt: skip
    many_pixels()  # made before serving: the first requests must not wait for it
    worker = WorkerProcess(env, tmp_path / "cpu.log", pool="cpu", args=("--concurrency", "1"))
    worker.start()
    try:
        with HostileServer() as server:
            # The first slice loads what every slice uses; the peak is measured after it.
            first = [{"url": f"{server.base}/photo.jpg", "caption": "a"}]
            write_list(tmp_path / "first.csv", first)
            sdq_json(env, "download", "--wait", str(tmp_path / "first.csv"), "--dataset", "first")
            before = peak_rss(worker)
            rows = [{"url": f"{server.base}/many-pixels/{n}.png", "caption": f"huge {n}"}
                    for n in range(8)]  # fmt: skip
            write_list(tmp_path / "huge.csv", rows)
            summary = sdq_json(env, "download", "--wait", str(tmp_path / "huge.csv"),
                               "--dataset", "huge")  # fmt: skip
        grown = peak_rss(worker) - before
    finally:
        worker.stop()
    # Every image was decoded (the seven copies are duplicates of the first's bytes).
    assert summary["by_status"] == {"success": 1, "duplicate": 7}
    assert grown < 2 * 3 * budget  # RGB bytes of the budget and a copy; all eight: 1.9 GB
