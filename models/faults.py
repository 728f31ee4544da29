"""Faults that are not the job's own, however they show (wrapped by SQLAlchemy, the store,
a library).

The machine's spend no attempt:
- A full disk: the operating system's "no space left" (or quota) from a file write,
  SQLite's "database or disk is full". The user learns which of sdq's places sit on it.
- A failing device: out of memory on a GPU, a CUDA, cuBLAS or cuDNN error. A worker whose
  device keeps failing on jobs that other workers then do is taken out of rotation.

A damaged weights file (one safetensors cannot read: cut short, overwritten) ends the jobs
at once: every attempt would read the same bytes, from a folder, the hub's cache or the
store's copy on the worker alike."""

import errno
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy.engine import make_url

from sdq.models.settings import Settings

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def full_disk(error: BaseException) -> BaseException | None:
    """The error, or one it was raised from or while handling, that says a disk is full:
    what to tell the user, without the wrappers' words; None when none does."""
    for link in _chain(error):
        if isinstance(link, OSError) and link.errno in FULL_ERRNOS:
            return link
        # The sqlite3 module's own errors (one statement at a time...) carry no code.
        if getattr(link, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
            return link
    return None


# What torch raises, by name and words, so that no CPU process imports torch to ask.
DEVICE_ERRORS = frozenset({"OutOfMemoryError", "AcceleratorError"})
DEVICE_WORDS = ("CUDA error", "CUDA out of memory", "CUBLAS_STATUS", "cuDNN error")


def device_failure(error: BaseException) -> BaseException | None:
    """The error, or one behind it, that says the device failed; None when none does."""
    for link in _chain(error):
        if type(link).__name__ in DEVICE_ERRORS or any(w in str(link) for w in DEVICE_WORDS):
            return link
    return None


# What safetensors raises on a file it cannot parse, by name (no CPU process imports it to ask).
DAMAGED_WEIGHTS_ERRORS = frozenset({"SafetensorError"})


def damaged_weights(error: BaseException) -> BaseException | None:
    """The error, or one behind it, that says a weights file cannot be read; None when none
    does."""
    for link in _chain(error):
        if type(link).__name__ in DAMAGED_WEIGHTS_ERRORS:
            return link
    return None


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        link = link.__cause__ or link.__context__


def local_places(settings: Settings) -> dict[str, Path]:
    """sdq's places on this machine's disks, by what they hold: the SQLite database, the
    store folder, the model cache (a database server or S3 has disks of its own)."""
    places = {"model cache": settings.model_cache_dir}
    database = make_url(settings.database_url)
    if database.get_backend_name() == "sqlite" and database.database:
        places["database"] = Path(database.database)
    if "://" not in settings.store_url:
        places["store"] = Path(settings.store_url)
    return places


def free_space(settings: Settings) -> str:
    """Each local place with the space left on its disk, e.g. "database sdq-data/sdq.db
    (0 B free)"."""
    return ", ".join(
        f"{what} {path} ({_size(_free_bytes(path))} free)"
        for what, path in sorted(local_places(settings).items())
    )


def _free_bytes(path: Path) -> int:
    """The space left on the disk that holds the path, or would hold it once made."""
    for place in (path, *path.absolute().parents):
        if place.exists():
            return shutil.disk_usage(place).free
    return 0


def _size(count: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1024:
            return f"{count} {unit}"
        count //= 1024
    return f"{count} TB"
