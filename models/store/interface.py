"""What every object store offers, and how it fails: a lasting refusal, or an outage that
retrying gets past."""

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

# The longest a presigned S3 link can live (SigV4): pages sdq writes stay openable a week.
LINK_SECONDS = 7 * 24 * 3600


PARQUET = "application/vnd.apache.parquet"


# A large object (a latent shard, ~170 MB at SD 2's 256 px) is read as ranged GETs of this
# size, this many at once.
LARGE_PART = 8 * 1024 * 1024


LARGE_PARTS_AT_ONCE = 8


class StoreError(Exception):
    """The store refused for a reason retrying will not fix (no bucket, bad credentials)."""


class MissingObject(StoreError):
    """No object under the key."""


class StoreUnavailable(StoreError):
    """The store could not be reached; the same call may succeed later."""


class MissingBucket(StoreError):
    """The S3 bucket is not there: `sdq db upgrade` makes it where the credentials may."""


class ObjectStore(Protocol):
    def put_bytes(self, key: str, data: bytes, *, content_type: str) -> str: ...
    def put_file(self, key: str, source: Path) -> str: ...
    def get_bytes(self, key: str) -> bytes: ...
    def get_large(self, key: str) -> bytes | memoryview: ...
    def get_file(self, key: str, destination: Path) -> None: ...
    def copy(self, source: str, key: str) -> str: ...
    def exists(self, key: str) -> bool: ...
    def delete(self, key: str) -> None: ...
    def list_keys(self, prefix: str) -> Iterator[str]: ...
    def uri(self, key: str) -> str: ...
    def link(self, key: str, *, expires_seconds: int) -> str: ...
    def check(self) -> None: ...
    def ensure(self) -> bool: ...
