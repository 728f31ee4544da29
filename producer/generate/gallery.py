"""A gallery to take anywhere: `sdq gallery RUN -o DIR` copies the page and its images.
The page itself is models/generate/galleries.py's, shared with beat's run finisher. Only
a generate run has one."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from sdq.models.generate.galleries import gallery_html
from sdq.models.generate.specs import image_key
from sdq.models.jobs.kinds import GENERATE
from sdq.models.store import ObjectStore, atomic_file
from sdq.producer import lookups
from sdq.producer.cli.common import InputError, found

COPY_THREADS = 16


def copy_gallery(store: ObjectStore, run_id: int, jobs: list[dict[str, Any]], folder: Path) -> Path:
    """A copy that needs nothing but itself: folder/gallery.html beside folder/images/."""
    done = [job["spec_hash"] for job in jobs if job["status"] == "succeeded" and not job["flagged"]]
    with ThreadPoolExecutor(COPY_THREADS) as pool:
        copies = [
            pool.submit(store.get_file, image_key(spec_hash), folder / image_key(spec_hash))
            for spec_hash in done
        ]
        for copy in copies:
            copy.result()
    page = folder / "gallery.html"
    with atomic_file(page) as handle:
        handle.write(gallery_html(run_id, jobs, image_key).encode())
    return page


def generation_run(session: Session, run_id: int) -> None:
    """Refuses a run that renders no images: its gallery would be an empty page."""
    with found():
        run = lookups.get_run(session, run_id)
    if run.kind != GENERATE.name:
        raise InputError(
            f"run {run_id} is a {run.kind} run: a gallery shows a {GENERATE.name} run's "
            f"images (`sdq status {run_id}` shows this one)"
        )
