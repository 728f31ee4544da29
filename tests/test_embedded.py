"""`sdq run` on a fresh machine: no services, no settings, everything under ./sdq-data."""

import csv
import html
import json
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

from PIL import Image

from tests.browser import chromium, open_page, texts
from tests.conftest import ROOT, sdq_json
from tests.services import clean_env, wait_for


def sdq_run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sdq.producer.cli", "run", *args],
        cwd=cwd,
        env={**clean_env(), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_run_does_the_whole_job_in_one_process(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    done = sdq_run(
        tmp_path,
        "examples/subjects.csv",
        "--styles",
        "examples/styles.txt",
        "--steps",
        "4",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    # sdq's output is sdq's: no library chatter about parts it never uses.
    assert "torchvision" not in done.stderr
    status = json.loads(done.stdout)
    subjects = len((tmp_path / "examples/subjects.csv").read_text().splitlines()) - 1
    styles = sum(
        1
        for line in (tmp_path / "examples/styles.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert status["total"] == subjects * styles == len(status["jobs"])
    assert status["counts"] == {"succeeded": status["total"]}
    images = sorted((tmp_path / "sdq-data/store/images").glob("*.png"))
    assert len(images) == status["total"]
    for job in status["jobs"]:
        path = Path(job["uri"].removeprefix("file://"))
        assert path.parent == (tmp_path / "sdq-data/store/images").resolve()
        assert Image.open(path).text["sdq-spec-hash"] == path.stem
    assert (tmp_path / "sdq-data/sdq.db").is_file()

    # Loading the model is counted apart from rendering, against the call that waited.
    with sqlite3.connect(tmp_path / "sdq-data/sdq.db") as db:
        loads, units = db.execute(
            "SELECT count(setup_seconds), sum(units) FROM jobs WHERE run_id = ?",
            (status["run_id"],),
        ).fetchone()
    assert loads == 8 and units == status["total"]  # the first call of 8 loaded the model

    # The contact sheet: a row per prompt row, labelled by its text, a column per style,
    # every image linked to its file, with its seed; the settings stated once.
    gallery = Path(status["gallery"].removeprefix("file://"))
    assert gallery == (tmp_path / f"sdq-data/store/runs/{status['run_id']}/gallery.html").resolve()
    assert status["gallery_link"] == gallery.as_uri()
    page = gallery.read_text()
    links = re.findall(r'<a href="([^"]+)"><img src="([^"]+)"', page)
    assert all(link == source for link, source in links)
    assert sorted((gallery.parent / source).resolve() for _, source in links) == [
        image.resolve() for image in images
    ]
    rows = re.findall(r'<th class="row">([^<]+)<br><small>line (\d+)</small>', page)
    with (tmp_path / "examples/subjects.csv").open() as subjects_file:
        expected = [
            (row["prompt"], str(n)) for n, row in enumerate(csv.DictReader(subjects_file), 2)
        ]
    assert [(html.unescape(text), line) for text, line in rows] == expected
    assert page.count("<th>") == 1 + styles
    assert "model tiny" in page and "4 steps, 64x64, sampler Euler" in page
    assert sorted(map(int, re.findall(r"<figcaption>seed (\d+)</figcaption>", page))) == sorted(
        job["seed"] for job in status["jobs"]
    )
    # As a person sees it: every image shown, rows and columns labelled.
    style_names = [
        line
        for line in (tmp_path / "examples/styles.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    with chromium() as browser:
        assert open_page(browser, gallery, tmp_path / "gallery.png") == [True] * status["total"]
        assert texts(browser, "thead th") == ["prompt", *style_names]
        assert [label.splitlines()[0] for label in texts(browser, "th.row")] == [
            html.unescape(text) for text, _ in rows
        ]
    assert Image.open(tmp_path / "gallery.png").size[0] > 0

    again = sdq_run(
        tmp_path, "examples/subjects.csv", "--styles", "examples/styles.txt", "--steps", "4"
    )
    assert again.returncode == 0, again.stderr
    assert (
        f"{status['total']} of {status['total']} images done, {status['total']} from cache"
        in again.stdout
    )
    assert "images: file://" in again.stdout
    env = {**clean_env(), "PYTHONPATH": str(ROOT)}
    rewritten = sdq_json(env, "gallery", str(status["run_id"]), cwd=tmp_path)
    assert rewritten == {
        "run_id": status["run_id"],
        "gallery": status["gallery"],
        "gallery_link": status["gallery_link"],
    }

    # A copy to take anywhere: the page and its images, linked relatively.
    copied = sdq_json(env, "gallery", str(status["run_id"]), "-o", "copy", cwd=tmp_path)
    page = (tmp_path / "copy/gallery.html").read_text()
    assert copied["gallery"] == "copy/gallery.html"
    sources = re.findall(r'<img src="([^"]+)"', page)
    assert all(source.startswith("images/") for source in sources)
    assert sorted((tmp_path / "copy" / source).read_bytes() for source in sources) == sorted(
        image.read_bytes() for image in images
    )
    with chromium() as browser:
        shown = open_page(browser, tmp_path / "copy/gallery.html", tmp_path / "copy.png")
    assert shown == [True] * status["total"]


def test_commands_that_send_refuse_without_a_broker(tmp_path: Path) -> None:
    # Sending into an in-memory broker nobody reads would mark jobs queued for ever.
    for command in (["requeue", "1"], ["submit", str(ROOT / "examples/subjects.csv")]):
        done = subprocess.run(
            [sys.executable, "-m", "sdq.producer.cli", *command],
            cwd=tmp_path,
            env={**clean_env(), "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2 and "needs a broker" in done.stderr, done.stderr
    assert not (tmp_path / "sdq-data").exists()


def test_ctrl_c_puts_the_jobs_in_hand_back_and_resume_finishes_the_run(tmp_path: Path) -> None:
    env = {**clean_env(), "PYTHONPATH": str(ROOT)}
    rows = "".join(f"interrupted {n},{n}\n" for n in range(48))
    (tmp_path / "p.csv").write_text("prompt,seed\n" + rows)
    database = tmp_path / "sdq-data/sdq.db"
    running = subprocess.Popen(
        [sys.executable, "-m", "sdq.producer.cli", "run", "p.csv", "--steps", "40", "--json"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip

    def rendering() -> bool:
        """The second message's jobs held while their images render (seconds at 40 steps):
        past the first, the pipeline is loaded, and the interrupt lands in the work, not in
        an import's finalizer, where Python would drop it."""
        try:
            with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as db:
                counts = dict(db.execute("SELECT status, count(*) FROM jobs GROUP BY status"))
        except sqlite3.OperationalError:  # not made yet, or its tables not yet
            return False
        return counts.get("succeeded", 0) > 0 and counts.get("running", 0) > 0

    wait_for(rendering, what="jobs being rendered", timeout=240)
    running.send_signal(signal.SIGINT)
    _, stderr = running.communicate(timeout=120)
    assert running.returncode == 130, stderr
    assert "`sdq resume 1` finishes them" in stderr
    with sqlite3.connect(database) as db:
        statuses = dict(db.execute("SELECT status, count(*) FROM jobs GROUP BY status").fetchall())
        put_back = db.execute(
            "SELECT count(*) FROM job_events WHERE detail = 'stopped by Ctrl-C'"
        ).fetchone()[0]
    assert "running" not in statuses and statuses.get("queued", 0) > 0  # nothing left held
    assert put_back > 0

    gallery = tmp_path / "sdq-data/store/runs/1/gallery.html"
    assert not gallery.exists()
    resumed = sdq_json(env, "resume", "1", cwd=tmp_path)
    assert resumed["counts"] == {"succeeded": 48}
    assert resumed["gallery_link"] == gallery.as_uri()  # written as `sdq run` writes it
    assert gallery.read_text().count("<img") == 48
    with sqlite3.connect(database) as db:
        attempts = {n for (n,) in db.execute("SELECT attempts FROM jobs WHERE NOT cached")}
    assert attempts == {1}  # the interrupted ones did not lose an attempt
    assert len(list((tmp_path / "sdq-data/store/images").glob("*.png"))) == 48
