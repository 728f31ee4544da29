"""Failures that may pass: a server's Retry-After is honoured within a fetch, and
`sdq download --retry-failed NAME` fetches again only the rows that failed for a
transient reason (or for the reasons named), keeping every other row as it was."""

import sqlite3
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from sdq.models.datasets import is_transient
from sdq.models.download.settings import DownloadSettings
from sdq.workers.download.fetch import Fetcher, FetchFailed
from tests.conftest import ROOT, run_sdq, sdq_json
from tests.hostile_server import HostileServer
from tests.netns_download import DOWNLOAD_ENV, write_list
from tests.services import clean_env

SETTINGS = DownloadSettings(allow_networks=("127.0.0.1/32",), retries=1, read_timeout=5)


@pytest.mark.parametrize(
    ("reason", "transient"),
    [
        ("timeout", True),
        ("connection failed", True),
        ("connection failed: SSLError", True),
        ("http 429", True),
        ("http 503", True),
        ("http 404", False),
        ("blocked address", False),
        ("not an image", False),
        ("host not found", False),
    ],
)
def test_which_reasons_may_pass(reason: str, transient: bool) -> None:
    assert is_transient(reason) is transient


def test_a_short_retry_after_is_waited_for_and_a_long_one_is_not() -> None:
    with HostileServer() as server:
        fetcher = Fetcher(SETTINGS)
        started = time.monotonic()
        fetched = fetcher.fetch(f"{server.base}/retry-after/1.jpg")
        assert time.monotonic() - started >= 1  # the server's word, not the 0.5 s backoff
        assert fetched.data[:2] == b"\xff\xd8"
        with pytest.raises(FetchFailed, match="http 429"):
            fetcher.fetch(f"{server.base}/retry-after/3600.jpg")
        assert server.server.RequestHandlerClass.hits["/retry-after/3600.jpg"] == 1


def test_retry_failed_fetches_only_transient_failures_again(tmp_path: Path) -> None:
    env = {**clean_env(), **DOWNLOAD_ENV, "PYTHONPATH": str(ROOT)}
    with HostileServer() as server:
        hits = server.server.RequestHandlerClass.hits
        paths = ["/photo.jpg", "/recovering.jpg", "/missing.jpg", "/busy.jpg", "/img/1.jpg"]
        rows = [{"url": server.base + path, "caption": f"row {path}"} for path in paths]
        write_list(tmp_path / "list.csv", rows)
        first = sdq_json(
            env, "download", str(tmp_path / "list.csv"), "--dataset", "flaky",
            "--rows-per-shard", "3", cwd=tmp_path,
        )  # fmt: skip
        assert first["reasons"] == {"http 404": 1, "http 429": 1, "http 503": 1}
        shard = tmp_path / "sdq-data/store/datasets/flaky/images/00000.parquet"
        before = pq.read_table(shard).to_pylist()
        fetched_before = dict(hits)

        again = sdq_json(env, "download", "--retry-failed", "flaky", cwd=tmp_path)
        fetched_again = {path: hits[path] - fetched_before.get(path, 0) for path in paths}

        # A dataset whose failures will not pass has nothing to retry: a run with no jobs,
        # finished as it is written.
        write_list(tmp_path / "gone.csv", [rows[2]])  # none of its rows fetched: exit 1
        sdq_json(env, "download", str(tmp_path / "gone.csv"), "--dataset", "gone", cwd=tmp_path,
                 exit_code=1)  # fmt: skip
        nothing = sdq_json(env, "download", "--retry-failed", "gone", cwd=tmp_path)
        assert nothing["by_status"] == {"failed": 1}
    assert again["reasons"] == {"http 404": 1, "http 429": 1}
    assert again["by_status"] == {"success": 3, "failed": 2}
    # Only the transient failures were asked for again.
    assert fetched_again == {
        "/photo.jpg": 0, "/recovering.jpg": 1, "/missing.jpg": 0, "/busy.jpg": 2, "/img/1.jpg": 0
    }  # fmt: skip
    after = pq.read_table(shard).to_pylist()
    assert after[0] == before[0]  # kept as it was, image bytes and all
    assert after[1]["status"] == "success" and after[1]["jpg"]
    assert after[2] == before[2]
    with sqlite3.connect(tmp_path / "sdq-data/sdq.db") as db:
        assert db.execute("SELECT count(*) FROM samples").fetchone()[0] == len(paths) + 1
        assert db.execute("SELECT count(*) FROM runs WHERE finished_at IS NULL").fetchone()[0] == 0
        assert db.execute(
            "SELECT status, reason FROM samples WHERE url LIKE '%/recovering.jpg'"
        ).fetchone() == ("success", None)


def test_every_retry_fetches_the_rows_it_names_though_the_last_one_failed_alike(
    tmp_path: Path,
) -> None:
    """A host down through the download and the first retry: that retry leaves the shard
    byte for byte as it was, and the second still fetches (it is not served the first's
    output), and gets the image."""
    env = {**clean_env(), **DOWNLOAD_ENV, "PYTHONPATH": str(ROOT)}
    with HostileServer() as server:
        hits = server.server.RequestHandlerClass.hits
        write_list(
            tmp_path / "list.csv", [{"url": f"{server.base}/down-for/4.jpg", "caption": "x"}]
        )
        sdq_json(env, "download", str(tmp_path / "list.csv"), "--dataset", "down", cwd=tmp_path,
                 exit_code=1)  # fmt: skip
        shard = tmp_path / "sdq-data/store/datasets/down/images/00000.parquet"
        before = shard.read_bytes()
        first = sdq_json(env, "download", "--retry-failed", "down", cwd=tmp_path, exit_code=1)
        assert first["reasons"] == {"http 503": 1}
        assert shard.read_bytes() == before
        second = sdq_json(env, "download", "--retry-failed", "down", cwd=tmp_path)
    assert hits["/down-for/4.jpg"] == 5  # two fetches of two tries each, then the image
    assert second["by_status"] == {"success": 1}


def test_blocked_hosts_are_explained_and_fetched_once_their_network_is_allowed(
    tmp_path: Path,
) -> None:
    """Every host of the list is a loopback address the settings do not open: the command
    says so and how to open it; once opened, the named reason is fetched again."""
    env = {**clean_env(), **DOWNLOAD_ENV, "PYTHONPATH": str(ROOT)}
    with HostileServer(host="127.0.0.2") as server:
        rows = [{"url": f"{server.base}/img/{n}.jpg", "caption": f"row {n}"} for n in range(3)]
        write_list(tmp_path / "mirror.csv", rows)
        blocked = run_sdq(env, "download", str(tmp_path / "mirror.csv"), "--dataset", "mirror",
                          "--json", cwd=tmp_path)  # fmt: skip
        assert blocked.returncode == 1, blocked.stderr
        hint = " ".join(blocked.stderr.split())
        assert "3 of 3 samples were not fetched" in hint
        assert "none of the 3 rows was fetched; why: `sdq dataset show mirror`" in hint
        assert "opens them; it opened 127.0.0.1/32 where they were fetched (here," in hint
        assert "in this shell" in hint
        assert '`sdq download --retry-failed mirror --reason "blocked address"`' in hint

        # The transient retry leaves them; the named reason fetches them again, blocked
        # again while the network is shut (the shard is byte for byte as it was), and
        # fetched once it is open.
        untouched = sdq_json(env, "download", "--retry-failed", "mirror", cwd=tmp_path)
        assert untouched["by_status"] == {"failed": 3}
        # A reason no sample failed for is a typo: the ones there are, not an empty run.
        typo = run_sdq(
            env, "download", "--retry-failed", "mirror", "--reason", "blocked", cwd=tmp_path
        )
        assert typo.returncode == 2
        said = " ".join(typo.stderr.split())
        assert "no sample of dataset 'mirror' failed for 'blocked'" in said
        assert "its failures: 'blocked address' (3)" in said
        for _ in range(2):
            still = sdq_json(env, "download", "--retry-failed", "mirror", "--reason",
                             "blocked address", cwd=tmp_path, exit_code=1)  # fmt: skip
            assert still["by_status"] == {"failed": 3}
        assert not server.server.RequestHandlerClass.hits
        opened = {**env, "SDQ_DOWNLOAD_ALLOW_NETWORKS": "127.0.0.0/8"}
        again = sdq_json(opened, "download", "--retry-failed", "mirror", "--reason",
                         "blocked address", cwd=tmp_path)  # fmt: skip
    assert again["by_status"] == {"success": 3}
    assert again["reasons"] == {}
