"""sdq dataset filter: a dataset made of another's kept samples that pass rules on their
curate scores, without near-duplicates, with no image copied; encoded, trained on and
traced back through, as any dataset is. Near-duplicates are planted in embeddings the
curate way and found, by one job and by clusters, with recall and precision 1.0."""

import os
import signal
import sqlite3
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import psycopg
import pyarrow.parquet as pq
import pytest
import torch
from selenium.webdriver.common.by import By
from sqlalchemy.orm import Session

from sdq.migrations import upgrade
from sdq.models.curate.specs import embeddings_key
from sdq.models.curate.tables import SampleScore
from sdq.models.datasets.tables import Dataset, Sample, Shard
from sdq.models.db import make_engine
from sdq.models.jobs.lifecycle import OUTAGE
from sdq.models.store import PARQUET, LocalStore
from sdq.workers.curate.dedup import Kmeans, near_duplicates
from sdq.workers.shards.embeddings import embedding_shard_bytes
from tests.browser import chromium, open_page, texts
from tests.conftest import (
    ROOT,
    BeatProcess,
    WorkerProcess,
    job_history,
    run_sdq,
    sdq_json,
    store_behind_a_proxy,
    wait_for_run,
)
from tests.hostile_server import HostileServer
from tests.netns_download import DOWNLOAD_ENV
from tests.services import clean_env, wait_for
from tests.test_curate import AESTHETIC, head_state, tiny_clip
from tests.test_encode import write_list

pytestmark = pytest.mark.timeout(600)


def sdq(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return run_sdq(env, *args, cwd=cwd)


def test_a_filtered_dataset_is_encoded_trained_on_and_traced_to_the_urls_it_kept(
    tmp_path: Path,
) -> None:
    env = {**clean_env(), **DOWNLOAD_ENV, "PYTHONPATH": str(ROOT)}
    clip = tiny_clip(tmp_path / "tiny-clip")
    aesthetic = head_state(*AESTHETIC, seed=1)
    # Scores about 5, as LAION's are: the last layer's weights small, its bias 5.
    aesthetic["layers.7.weight"] *= 0.01
    aesthetic["layers.7.bias"].fill_(5.0)
    torch.save(aesthetic, tmp_path / "aesthetic.pth")
    with HostileServer() as server:
        listing = write_list(tmp_path / "list.csv", server.base, 16)
        sdq_json(env, "download", str(listing), "--dataset", "pets", "--resolution", "64",
                 "--rows-per-shard", "6", cwd=tmp_path)  # fmt: skip
    database = tmp_path / "sdq-data/sdq.db"

    # Before any curate run: a score rule is refused; a size rule needs no scores.
    never = sdq(env, tmp_path, "dataset", "filter", "pets", "--into", "x", "--min-aesthetic", "5")
    assert never.returncode == 2 and "dataset 'pets' was never curated" in never.stderr
    sdq_json(env, "curate", "pets", "--model", str(clip), "--aesthetic-head",
             str(tmp_path / "aesthetic.pth"), cwd=tmp_path)  # fmt: skip
    with sqlite3.connect(database) as db:
        scored = db.execute(
            "SELECT key, url, aesthetic, clip_score FROM sample_quality "
            "WHERE dataset = 'pets' AND kept ORDER BY aesthetic"
        ).fetchall()
    assert len(scored) == 15  # the list's broken row kept no image
    cut = (scored[5][2] + scored[6][2]) / 2  # the 6 lowest fall under it

    # Bad inputs: exit 2, the option and value named, nothing written.
    refusals = [
        (("--max-nsfw", "2"), "Invalid value for '--max-nsfw': 2.0 is not in the range 0<=x<=1"),
        (("--max-nsfw", "0.5"), "--max-nsfw: 15 of the 15 kept samples of 'pets' have no nsfw"),
        (("--min-aesthetic", "99"), "keep none of the 15 samples of 'pets'"),
        (("--min-clip-score", "100"), "keep none of the 15 samples of 'pets'"),
        (("--into", "pets", "--min-size", "8"), "--into pets: a dataset of that name exists"),
        ((), "give at least one rule"),
    ]  # fmt: skip
    for options, message in refusals:
        into = () if "--into" in options else ("--into", "best")
        refused = sdq(env, tmp_path, "dataset", "filter", "pets", *into, *options)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
    with sqlite3.connect(database) as db:
        assert db.execute("SELECT count(*) FROM datasets").fetchone() == (1,)

    # The filter: members and the left-out with their reasons, in SQL.
    shown = sdq_json(env, "dataset", "filter", "pets", "--into", "best", "--min-aesthetic",
                     f"{cut:.6f}", "--min-size", "8", cwd=tmp_path)  # fmt: skip
    assert shown["made_of"] == "pets" and shown["removed"] == {"aesthetic": 6}
    assert shown["by_status"] == {"success": 9, "filtered": 6}
    assert shown["filter"] == {"min_aesthetic": pytest.approx(cut), "min_size": 8}
    with sqlite3.connect(database) as db:
        quality = db.execute("SELECT key, url, aesthetic, kept, reason FROM sample_quality "
                             "WHERE dataset = 'best' ORDER BY aesthetic").fetchall()  # fmt: skip
    assert [(key, url, aesthetic) for key, url, aesthetic, *_ in quality] == [
        row[:3] for row in scored
    ]  # the parent's scores, read through each copy's origin
    for _, _, aesthetic, kept, reason in quality[:6]:
        assert not kept and reason == f"aesthetic {aesthetic:.2f} < {cut:g}"
    assert all(kept and reason is None for *_, kept, reason in quality[6:])
    # No image was copied: the new dataset's shards are the parent's files.
    store = tmp_path / "sdq-data/store"
    assert not (store / "datasets/best").exists()
    said = sdq(env, tmp_path, "dataset", "show", "best").stdout
    assert "dataset best: 15 samples, 9 kept" in " ".join(said.split())
    # Its page: each score's histogram with the cut, the samples at either end as images.
    page = sdq_json(env, "dataset", "show", "best", cwd=tmp_path)
    aesthetic = page["scores"]["aesthetic"]
    assert sum(aesthetic["histogram"]) == 15 and aesthetic["histogram"][0] >= 1
    assert [sample["key"] for sample in aesthetic["lowest"]] == [row[0] for row in scored[:4]]
    assert [sample["key"] for sample in aesthetic["highest"]] == [row[0] for row in scored[:-5:-1]]
    with chromium() as browser:
        path = Path(page["page"].removeprefix("file://"))
        shown = open_page(browser, path, tmp_path / "best.png")
        assert shown == [True] * (4 * 2 * 2 + 9)  # 2 scores x both ends x 4, the members
        assert texts(browser, "table.removed td") == ["aesthetic", "6"]
        bars = sum(len(page["scores"][score]["histogram"]) for score in ("clip_score", "aesthetic"))
        assert len(browser.find_elements(By.CSS_SELECTOR, "svg.histogram rect.bar")) == bars
        cuts = browser.find_elements(By.CSS_SELECTOR, "svg.histogram rect.cut")
        assert len(cuts) == 1 and cuts[0].is_displayed()
        lowest = texts(browser, ".lowest figcaption")
        assert [line.split()[0] for line in lowest[4:]] == [row[0] for row in scored[:4]]

    # Encode reads the parent's files and keeps the members; train and generate follow.
    sdq_json(env, "encode", "best", "--model", "tiny", "--resolution", "64", cwd=tmp_path)
    latent_keys = sorted(
        key
        for path in (store / "datasets/best").glob("latents-*/*.parquet")
        for key in pq.read_table(path, columns=["key"])["key"].to_pylist()
    )
    members = sorted(key for key, *_, kept, _ in quality if kept)
    assert latent_keys == members
    trained = sdq_json(env, "train", "best", "--base", "tiny", "--resolution", "64",
                       "--batch-size", "4", "--steps", "2", "--into", "best-model",
                       cwd=tmp_path)  # fmt: skip
    assert trained["status"] == "succeeded"
    prompts = tmp_path / "prompts.csv"
    prompts.write_text("prompt,seed\na picture,1\n")
    made = sdq_json(env, "run", str(prompts), "--model", "best-model", "--steps", "2",
                    "--dtype", "float32", "--size", "64x64", cwd=tmp_path)  # fmt: skip
    with sqlite3.connect(database) as db:
        sources = db.execute(
            "SELECT url FROM image_sources WHERE job_id = ?", (made["jobs"][0]["id"],)
        ).fetchall()
    assert sorted(url for (url,) in sources) == sorted(url for _, url, *_, kept, _ in quality
                                                       if kept)  # fmt: skip


def test_curate_and_filter_name_a_dataset_with_no_usable_samples(tmp_path: Path) -> None:
    env = {**clean_env(), **DOWNLOAD_ENV, "PYTHONPATH": str(ROOT)}
    clip = tiny_clip(tmp_path / "tiny-clip")
    with HostileServer() as server:
        listing = tmp_path / "gone.csv"
        listing.write_text("url,caption\n" + "".join(
            f"{server.base}/missing-{n}.jpg,gone {n}\n" for n in range(3)))  # fmt: skip
        sdq_json(env, "download", str(listing), "--dataset", "gone", cwd=tmp_path, exit_code=1)
    said = "dataset 'gone' has no usable samples: all 3 downloaded so far failed or were duplicates"
    for args in (("curate", "gone", "--model", str(clip)),
                 ("dataset", "filter", "gone", "--into", "kept", "--min-size", "8")):  # fmt: skip
        refused = sdq(env, tmp_path, *args)
        assert refused.returncode == 2 and said in " ".join(refused.stderr.split())
    with sqlite3.connect(tmp_path / "sdq-data/sdq.db") as db:
        assert db.execute("SELECT count(*) FROM datasets").fetchone() == (1,)
        assert db.execute("SELECT count(*) FROM runs WHERE kind = 'curate'").fetchone() == (0,)


def planted_dataset(tmp_path: Path, database_url: str, store: LocalStore) -> dict[str, set[str]]:
    """A curated dataset as curate leaves one, 1,600 samples over 8 shards of 32-wide CLIP
    embeddings around 8 centres, where 60 samples are near-duplicates (cosine > 0.99) of
    another. Returns each sample its group leaves out (all but the best aesthetic) -> the
    group's better samples, of which it is a near-duplicate."""
    rng = np.random.default_rng(7)
    width, samples = 32, 1_600
    centres = rng.standard_normal((8, width)) * 1.5  # no two apart reach cosine 0.94
    vectors = centres[rng.integers(0, 8, samples)] + rng.standard_normal((samples, width))
    aesthetic = rng.uniform(1, 9, samples)
    planted: dict[int, int] = {}  # duplicate row -> the row it copies
    originals = rng.choice(samples, 40, replace=False)
    free = iter(np.setdiff1d(np.arange(samples), originals))
    for number, original in enumerate(originals):
        for _ in range(1 + number % 2):  # groups of 2 and 3
            copy = next(free)
            vectors[copy] = vectors[original] + rng.standard_normal(width) * 0.01
            planted[int(copy)] = int(original)
    keys = [f"{row:09d}" for row in range(samples)]
    expected = {}
    for original in originals:
        group = [int(original)] + [copy for copy, of in planted.items() if of == original]
        best = max(group, key=lambda row: aesthetic[row])
        for row in group:
            if row != best:
                better = {keys[other] for other in group if aesthetic[other] > aesthetic[row]}
                expected[keys[row]] = better

    engine = make_engine(database_url)
    upgrade(engine)
    with Session(engine) as session, session.begin():
        dataset = Dataset(name="planted", options={"resolution": 64, "format": "jpg"})
        session.add(dataset)
        session.flush()
        for number in range(8):
            rows = range(number * 200, (number + 1) * 200)
            shard = Shard(dataset_id=dataset.id, number=number, source_uri="planted.csv",
                          source_id="planted", first_row=rows[0], row_count=200,
                          uri=f"file:///{number}", sha256=f"{number:064d}")  # fmt: skip
            session.add(shard)
            session.flush()
            for row in rows:
                sample = Sample(dataset_id=dataset.id, shard_id=shard.id, key=keys[row],
                                url=f"http://127.0.0.1/{row}.jpg", caption=str(row),
                                                status="success", original_width=64,
                                original_height=64)  # fmt: skip
                session.add(sample)
                session.flush()
                session.add(SampleScore(sample_id=sample.id, dataset_id=dataset.id,
                                        model_revision="r" * 64, scorer="s" * 64,
                                        clip_score=30.0, aesthetic=float(aesthetic[row]),
                                        scored_at=datetime.now(UTC)))  # fmt: skip
            data = embedding_shard_bytes([keys[row] for row in rows],
                                         vectors[rows].astype(np.float16), {})  # fmt: skip
            store.put_bytes(embeddings_key("planted", "r" * 64, number), data, content_type=PARQUET)
    return expected


@pytest.mark.parametrize("clusters", ["0", "8"])
def test_dedup_finds_every_planted_near_duplicate_and_nothing_else(
    tmp_path: Path, clusters: str
) -> None:
    """One job over every member, or k-means and a job per cluster (the embedded way: the
    clustering job's cluster jobs run here after it)."""
    env = {**clean_env(), "PYTHONPATH": str(ROOT)}
    store = LocalStore(tmp_path / "sdq-data/store")
    expected = planted_dataset(tmp_path, f"sqlite:///{tmp_path / 'sdq-data/sdq.db'}", store)
    shown = sdq_json(env, "dataset", "filter", "planted", "--into", "unique", "--dedup", "0.95",
                     "--dedup-clusters", clusters, cwd=tmp_path)  # fmt: skip
    assert shown["removed"] == {"near-duplicate": len(expected)}
    with sqlite3.connect(tmp_path / "sdq-data/sdq.db") as db:
        left_out = db.execute("SELECT key, reason FROM samples s JOIN datasets d ON "
                              "d.id = s.dataset_id WHERE d.name = 'unique' AND "
                              "s.status = 'filtered'").fetchall()  # fmt: skip
        jobs = db.execute("SELECT status, count(*) FROM jobs WHERE kind = 'curate' "
                          "GROUP BY status").fetchall()  # fmt: skip
        [(first_job, run)] = db.execute("SELECT id, run_id FROM jobs WHERE kind = 'curate' "
                                        "ORDER BY id LIMIT 1").fetchall()  # fmt: skip
    found = {key: reason.split()[2] for key, reason in left_out}
    assert found.keys() == expected.keys()  # recall and precision 1.0: each group its best
    assert all(found[key] in better for key, better in expected.items())
    assert all(float(reason[-5:-1]) >= 0.95 for _, reason in left_out)
    assert jobs == [("succeeded", 1 if clusters == "0" else 1 + int(clusters))]
    # Shown as every kind's jobs are, with the fields of a near-duplicate job's spec.
    shown_job = sdq_json(env, "show", str(first_job), cwd=tmp_path)
    assert (shown_job["dataset"], shown_job["threshold"]) == ("unique", 0.95)
    listed = sdq_json(env, "status", str(run), cwd=tmp_path)["jobs"]
    assert {job["threshold"] for job in listed} == {0.95} and len(listed) == sum(jobs[0][1:])
    # The dataset is readable once its run is done: a dataset being made is refused.
    with sqlite3.connect(tmp_path / "sdq-data/sdq.db") as db:
        db.execute("UPDATE runs SET finished_at = NULL WHERE kind = 'curate'")
    refused = sdq(env, tmp_path, "encode", "unique", "--model", "tiny", "--resolution", "64")
    assert refused.returncode == 2
    assert "dataset 'unique' is still being made by run 1" in refused.stderr


def test_clusters_of_a_small_dataset_say_nothing_on_stderr(capfd: pytest.CaptureFixture) -> None:
    """faiss writes a warning to stderr itself (past any log level) for fewer than 39 points
    a cluster: a small dataset's `--dedup-clusters` is what its user asked for."""
    points = np.random.default_rng(0).normal(size=(36, 8)).astype(np.float32)
    assert Kmeans(points, 2, seed=1).centroids.shape == (2, 8)
    assert capfd.readouterr().err == ""


def test_near_duplicates_are_the_exact_pairs_over_the_threshold() -> None:
    """Against a plain all-pairs computation: each sample worse than a sample at or over
    the threshold is out, as a duplicate of its most similar better sample."""
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((1_300, 6)).astype(np.float32)  # blocks of 512 and a rest
    # 200 copies of others, their cosines spread across the threshold.
    copies = rng.choice(1_300, 400, replace=False)
    noise = rng.uniform(0.05, 0.3, (200, 1)) * rng.standard_normal((200, 6))
    vectors[copies[:200]] = vectors[copies[200:]] + noise.astype(np.float32)
    ranks = rng.uniform(size=1_300)
    keys = [f"k{row}" for row in range(1_300)]
    found = near_duplicates(keys, vectors, ranks, 0.99)
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    cosine = unit @ unit.T
    expected = {}
    for row in range(1_300):
        better = np.flatnonzero(ranks > ranks[row])
        if len(better) and cosine[row, better].max() >= 0.99:
            nearest = better[cosine[row, better].argmax()]
            expected[keys[row]] = (keys[nearest], pytest.approx(cosine[row, nearest], abs=1e-5))
    assert len(expected) > 20 and found == expected


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_curate_and_dedup_on_services_survive_a_store_outage_and_a_killed_worker(
    own_deployment: dict[str, str], s3: dict[str, str], tmp_path: Path
) -> None:
    """The faults every kind meets, met by curate as by the others: the store goes away
    under its jobs (waited out, no attempt spent), and the GPU worker is killed with its
    pool while one runs (its jobs done by a new worker once the lease runs out). Every kept
    sample ends scored once. Then a clustered dedup on the services: the clustering job's
    cluster jobs travel through the broker to the worker, and the run ends."""
    clip = tiny_clip(tmp_path / "tiny-clip")
    with store_behind_a_proxy(own_deployment, s3, "curate-faults") as (env, proxy):
        database_url = env["SDQ_DATABASE_URL"]
        gpu = WorkerProcess(env, tmp_path / "gpu.log").start()
        helpers = [WorkerProcess(env, tmp_path / "cpu.log", pool="cpu").start(),
                   BeatProcess(env, tmp_path / "beat.log").start()]  # fmt: skip
        try:
            with HostileServer() as server:
                listing = write_list(tmp_path / "list.csv", server.base, 12)
                sdq_json(env, "download", str(listing), "--dataset", "hens", "--resolution",
                         "64", "--rows-per-shard", "4", "--wait", cwd=tmp_path)  # fmt: skip
            proxy.outage()
            # Submitted from a machine that still reaches the store; the workers do not.
            submitting = {**env, "AWS_ENDPOINT_URL": s3["AWS_ENDPOINT_URL"]}
            run_id = sdq_json(submitting, "curate", "hens", "--model", str(clip),
                              "--batch-size", "1", cwd=tmp_path)["run_id"]  # fmt: skip
            wait_for(lambda: any(OUTAGE in (detail or "") for _, _, detail, _ in
                                 job_history(database_url, run_id)),
                     what="a curate job to meet the outage", timeout=120)  # fmt: skip
            wait_for(lambda: any(status == "running" for _, status, *_ in
                                 job_history(database_url, run_id)[-1:]),
                     what="a curate job to run again", timeout=60)  # fmt: skip
            os.killpg(gpu.process.pid, signal.SIGKILL)  # the parent and every child at once
            gpu.process.wait()
            proxy.restore()
            gpu = WorkerProcess(env, tmp_path / "gpu-2.log").start()
            assert wait_for_run(database_url, run_id) == {"succeeded": 3}
            with psycopg.connect(database_url) as connection:
                scored = connection.execute(
                    "SELECT count(*), count(DISTINCT sample_id) FROM sample_scores"
                ).fetchone()
                kept = connection.execute(
                    "SELECT count(*) FROM samples WHERE status = 'success'"
                ).fetchone()[0]
            assert scored == (kept, kept) and kept == 11  # the list's broken row: no image
            history = job_history(database_url, run_id)
            assert all(attempts <= 2 for *_, attempts in history)
            # Setbacks: only the outage's, which spend no attempt.
            setbacks = [detail for _, status, detail, _ in history if status in ("failed", "dead")]
            assert setbacks and all(OUTAGE in detail for detail in setbacks)

            shown = sdq_json(env, "dataset", "filter", "hens", "--into", "hens-unique",
                             "--dedup", "0.999", "--dedup-clusters", "2", "--wait",
                             cwd=tmp_path)  # fmt: skip
            assert shown["made_of"] == "hens" and sum(shown["by_status"].values()) == kept
            # The rest of the chain on the services: encode, train, generate, lineage.
            sdq_json(env, "encode", "hens-unique", "--model", "tiny", "--resolution", "64",
                     "--wait", cwd=tmp_path)  # fmt: skip
            sdq_json(env, "train", "hens-unique", "--base", "tiny", "--resolution", "64",
                     "--batch-size", "4", "--steps", "2", "--into", "hens-model", "--wait",
                     cwd=tmp_path)  # fmt: skip
            prompts = tmp_path / "prompts.csv"
            prompts.write_text("prompt,seed\na hen,1\n")
            made = sdq_json(env, "submit", str(prompts), "--model", "hens-model", "--steps",
                            "2", "--size", "64x64", "--wait", cwd=tmp_path)  # fmt: skip
        finally:
            for process in [gpu, *helpers]:
                process.stop()
    with psycopg.connect(database_url) as connection:
        jobs = connection.execute(
            "SELECT j.status, j.spec->>'cluster' FROM jobs j JOIN runs r ON r.id = j.run_id "
            "WHERE r.kind = 'curate' AND r.options->>'dataset' = 'hens-unique' ORDER BY j.id"
        ).fetchall()
    assert jobs[0] == ("succeeded", None) and len(jobs) in (2, 3)  # the clusters with members
    assert all(status == "succeeded" for status, _ in jobs)
    assert sorted(cluster for _, cluster in jobs[1:]) == [str(n) for n in range(len(jobs) - 1)]
    with psycopg.connect(database_url) as connection:
        sources = connection.execute(
            "SELECT q.url FROM image_sources q JOIN jobs j ON j.id = q.job_id WHERE j.run_id = %s",
            (made["run_id"],),
        ).fetchall()
        members = connection.execute(
            "SELECT url FROM sample_quality WHERE dataset = 'hens-unique' AND kept"
        ).fetchall()
    assert sorted(sources) == sorted(members) and members
