"""`sdq run` on a fresh machine: no services, no settings, everything under ./sdq-data."""

import csv
import html
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from sdq.models.generate.galleries import describe_settings
from tests.browser import chromium, open_page, texts
from tests.conftest import ROOT, run_sdq, sdq_json
from tests.services import clean_env, said_after, wait_for


def embedded_env() -> dict[str, str]:
    """No service set: the embedded default, sdq importable from anywhere."""
    return {**clean_env(), "PYTHONPATH": str(ROOT)}


def sdq_run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return run_sdq(embedded_env(), "run", *args, cwd=cwd, timeout=300)


def test_a_gallery_says_what_an_auto_dtype_meant() -> None:
    """A pushed or trained model's default dtype is decided where the work ran."""
    spec = {"model_name": "pets-v1", "model_revision": "ab" * 32, "steps": 4, "width": 64,
            "height": 64, "scheduler": "euler", "guidance": 7.5, "dtype": "auto"}  # fmt: skip
    assert describe_settings([spec]).endswith(
        ", CFG 7.5, auto (float16 on a GPU, float32 on a CPU)"
    )


def test_run_does_the_whole_job_in_one_process(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    # A fresh interpreter, not a preloaded one: what the libraries say as they load is looked at.
    done = subprocess.run(
        [sys.executable, "-m", "sdq.producer.cli", "run", "examples/subjects.csv", "--styles",
         "examples/styles.txt", "--steps", "4", "--json"],
        cwd=tmp_path, env=embedded_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # sdq's output is sdq's: no library chatter about parts it never uses.
    assert "torchvision" not in done.stderr
    # The work here takes its share of the cores, and says so.
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert f"working here on {threads} torch thread" in done.stderr
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
    assert "CFG 7.5, float32" in page  # tiny's own dtype
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
    env = embedded_env()
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
        done = run_sdq(embedded_env(), *command, cwd=tmp_path, timeout=60)
        assert done.returncode == 2 and "needs a broker" in done.stderr, done.stderr
    assert not (tmp_path / "sdq-data").exists()


@pytest.mark.parametrize(
    ("number", "stopped_by", "status"),
    [(signal.SIGINT, "Ctrl-C", 130), (signal.SIGTERM, "SIGTERM", 143)],
    ids=["ctrl-c", "sigterm"],
)
def test_ctrl_c_puts_the_jobs_in_hand_back_and_resume_finishes_the_run(
    tmp_path: Path, number: int, stopped_by: str, status: int
) -> None:
    """Ctrl-C, or a SIGTERM (`timeout`, a service manager, `kill`), which ended the process
    where it stood, its jobs held until their lease ran out and nothing said."""
    env = embedded_env()
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
    running.send_signal(number)
    stderr = said_after(running, timeout=120)
    assert running.returncode == status, stderr
    assert re.search(r"\d+ jobs? in hand put back; `sdq resume 1` finishes the rest",
                     " ".join(stderr.split()))  # fmt: skip
    with sqlite3.connect(database) as db:
        statuses = dict(db.execute("SELECT status, count(*) FROM jobs GROUP BY status").fetchall())
        put_back = db.execute(
            "SELECT count(*) FROM job_events WHERE detail = ?", (f"stopped by {stopped_by}",)
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


def test_ctrl_c_before_the_work_stops_the_command_as_cleanly_as_in_it(tmp_path: Path) -> None:
    """Ctrl-C while the prompt file is read, and as the work here begins (torch imported:
    cut short, that left a process which could not import it again, and failed with a
    traceback or crashed as it stopped): the status a shell gives and a line each time,
    never a traceback or click's "Aborted!". Nothing of the file is kept; the run, once
    made, finishes with `sdq resume`."""
    env = embedded_env()

    def sdq(said: Path, *args: str) -> subprocess.Popen:
        with said.open("w") as stderr:
            return subprocess.Popen([sys.executable, "-m", "sdq.producer.cli", *args],
                                    cwd=tmp_path, env=env, stderr=stderr)  # fmt: skip

    def stopped(command: subprocess.Popen, said: Path, meanwhile=lambda: None) -> str:
        command.send_signal(signal.SIGINT)
        meanwhile()
        try:
            command.wait(timeout=120)
        except subprocess.TimeoutExpired:
            command.kill()
            raise AssertionError(f"still running; it said: {said.read_text()}") from None
        stderr = said.read_text()
        assert command.returncode == 130, stderr
        assert "Traceback" not in stderr and "Aborted" not in stderr, stderr
        return " ".join(stderr.split())

    # A file piped in, its first rows come and the rest awaited: the command waits for the
    # read under way before it stops (that read is on a thread), so the pipe is closed.
    os.mkfifo(tmp_path / "piped.csv")
    reading = sdq(tmp_path / "reading.txt", "run", "piped.csv")
    with open(tmp_path / "piped.csv", "w") as piped:  # opened once the command reads it
        piped.write("prompt,seed\nhalf a file,1\n")
        piped.flush()
        said = stopped(reading, tmp_path / "reading.txt",
                       meanwhile=lambda: (time.sleep(2), piped.close()))  # fmt: skip
    assert "stopped by Ctrl-C" in said
    database = tmp_path / "sdq-data/sdq.db"
    with sqlite3.connect(database) as db:
        assert db.execute("SELECT count(*) FROM runs").fetchone() == (0,)

    # The run made, the work here begins: it says so, then imports torch.
    (tmp_path / "p.csv").write_text("prompt,seed\nbegun,1\nand resumed,2\n")
    beginning = sdq(tmp_path / "beginning.txt", "run", "p.csv", "--steps", "2")
    wait_for(lambda: "working here" in (tmp_path / "beginning.txt").read_text(),
             what="the work to begin", timeout=120)  # fmt: skip
    said = stopped(beginning, tmp_path / "beginning.txt")
    with sqlite3.connect(database) as db:
        [(run_id,)] = db.execute("SELECT id FROM runs").fetchall()
    assert f"`sdq resume {run_id}` finishes the rest" in said
    assert sdq_json(env, "resume", str(run_id), cwd=tmp_path)["counts"] == {"succeeded": 2}


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MB disk of its own (tmpfs), unmounted on the way out whatever happened."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)


@pytest.mark.parametrize(("full", "room"), [("store", 400_000), ("home", 800_000)])
def test_a_full_disk_stops_the_run_clearly_and_one_resume_finishes_it(
    small_disk: Path, tmp_path: Path, full: str, room: int
) -> None:
    """The store's disk fills mid-run, alone or with the database on it (which then cannot
    even record the stop): the command says what is full and what is kept, without a
    traceback or a spent attempt, and once space is freed one `sdq resume` finishes."""
    home = small_disk / "home" if full == "home" else tmp_path / "home"
    env = {**embedded_env(), "SDQ_HOME": str(home), "SDQ_STORE_URL": str(small_disk / "store")}
    rows = "".join(f"a full disk {n},{n}\n" for n in range(64))
    (tmp_path / "p.csv").write_text("prompt,seed\n" + rows)
    # The database is made before the disk fills: it fills in the run.
    make_database = [sys.executable, "-m", "sdq.producer.cli", "db", "upgrade"]
    subprocess.run(make_database, env=env, check=True, capture_output=True)
    ballast = small_disk / "ballast"  # what the user deletes to free space
    ballast.write_bytes(b"\0" * (shutil.disk_usage(small_disk).free - room))
    stopped = run_sdq(env, "run", "p.csv", "--steps", "2", cwd=tmp_path, timeout=300)
    said = " ".join(stopped.stderr.split())
    assert stopped.returncode == 1, stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert "no space left on a disk sdq writes to" in said
    assert f"store {small_disk / 'store'} (" in said
    assert "`sdq resume 1` finishes the rest" in said
    finished = int(re.search(r"stopped: (\d+) of 64 jobs finished, and kept", said)[1])
    with sqlite3.connect(home / "sdq.db") as db:
        statuses = dict(db.execute("SELECT status, count(*) FROM jobs GROUP BY status"))
        assert max(n for (n,) in db.execute("SELECT attempts FROM jobs")) <= 1
    assert 0 < statuses.pop("succeeded", 0) == finished < 64, said
    if full == "store":  # the database took the stop: nothing is left held
        assert re.search(r"jobs? in hand put back", said) and "running" not in statuses
    else:  # the database fills too: whether it could still record the stop is the disk's call
        assert re.search(r"the jobs in hand could not be put back \(database or disk is full\)|"
                         r"0 jobs in hand put back", said), said  # fmt: skip

    ballast.unlink()
    resumed = sdq_json(env, "resume", "1", cwd=tmp_path)
    assert resumed["counts"] == {"succeeded": 64}
    with sqlite3.connect(home / "sdq.db") as db:
        attempts = {n for (n,) in db.execute("SELECT attempts FROM jobs WHERE NOT cached")}
        succeeded = db.execute(
            "SELECT count(*), count(DISTINCT job_id) FROM job_events WHERE status = 'succeeded'"
        ).fetchone()
    assert attempts == {1}  # the full disk spent none
    assert succeeded == (64, 64)  # each job done once
    assert len(list((small_disk / "store/images").glob("*.png"))) == 64
