"""The object store: one interface over S3 (any S3-compatible endpoint) and a local folder
(interface.py), whichever a URL names.

Every write is atomic: an object is visible under its final key complete or not at all.
S3 gives that for a single PUT (s3.py); the local store writes a temporary file and renames
it (local.py).
"""

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from sdq.models.store.interface import (
    LARGE_PART,
    LARGE_PARTS_AT_ONCE,
    LINK_SECONDS,
    PARQUET,
    MissingBucket,
    MissingObject,
    ObjectStore,
    StoreError,
    StoreUnavailable,
)
from sdq.models.store.local import LocalStore, atomic_file
from sdq.models.store.s3 import S3Store

__all__ = [
    "LARGE_PART",
    "LARGE_PARTS_AT_ONCE",
    "LINK_SECONDS",
    "PARQUET",
    "LocalStore",
    "MissingBucket",
    "MissingObject",
    "ObjectStore",
    "S3Store",
    "StoreError",
    "StoreUnavailable",
    "atomic_file",
    "existing",
    "open_store",
]


def open_store(url: str) -> ObjectStore:
    """`s3://bucket/prefix`, `file:///path` or a plain path."""
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        return S3Store.from_uri(url)
    if parsed.scheme == "file":
        return LocalStore(Path(parsed.path))
    if not parsed.scheme:
        return LocalStore(Path(url))
    raise StoreError(
        f"unsupported store URL {url!r}: use s3://bucket/prefix, file:///path or a folder"
    )


# HEAD requests in flight at once when many outputs are checked.
EXISTENCE_THREADS = 32


def existing(uris: Iterable[str]) -> set[str]:
    """Those of the URIs (s3:// or file://, as stores return them) whose object, or folder
    of objects (a checkpoint), is there now: one HEAD each, many at once. A store that
    cannot be asked raises."""
    wanted = sorted(set(uris))
    if not wanted:
        return set()
    with ThreadPoolExecutor(min(EXISTENCE_THREADS, len(wanted))) as pool:
        found = pool.map(_exists, wanted)
        return {uri for uri, there in zip(wanted, found, strict=True) if there}


def _exists(uri: str) -> bool:
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        bucket, key = _bucket(parsed.netloc), parsed.path.lstrip("/")
        return bucket.exists(key) or bucket.holds_any(f"{key}/")
    if parsed.scheme == "file":
        return Path(url2pathname(parsed.path)).exists()
    raise StoreError(f"not an object URI: {uri!r}")


@cache
def _bucket(name: str) -> S3Store:
    """One store (and so one boto3 client) per bucket for the whole process."""
    return S3Store(name)
