"""A local folder as the object store (embedded mode, a mounted volume): every write goes to a
temporary file beside the target and is renamed over it, so an object is there complete or
not at all."""

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from sdq.models.store.interface import MissingObject, StoreError

CHUNK = 8 * 1024 * 1024


def _umask() -> int:
    """The process's umask (reading it means setting it: set it straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


# What a new file's mode becomes, read once at import, before any thread of the process
# could create a file while the umask is briefly 0.
FILE_MODE = 0o666 & ~_umask()


@contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """Write beside the target, then rename over it: readers see the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file private (0600); the umask decides, as for any other file.
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as handle:
            yield handle
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _partial(path: Path) -> bool:
    """A file atomic_file is still writing (a dotfile such as DCP's `.metadata` is not)."""
    return path.name.startswith(".") and path.name.endswith(".tmp")


class LocalStore:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root):
            raise StoreError(f"key escapes the store root: {key!r}")
        return path

    def put_bytes(self, key: str, data: bytes, *, content_type: str) -> str:
        path = self._path(key)
        with atomic_file(path) as handle:
            handle.write(data)
        return self.uri(key)

    def put_file(self, key: str, source: Path) -> str:
        with atomic_file(self._path(key)) as handle, source.open("rb") as reader:
            shutil.copyfileobj(reader, handle, CHUNK)
        return self.uri(key)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise MissingObject(f"no object {self.uri(key)}") from None

    def get_large(self, key: str) -> memoryview:
        """A large object mapped into memory, not copied: its pages come from the page cache
        as they are read, and a reader of a few columns touches only theirs."""
        import pyarrow as pa  # here: every `sdq` command imports this module

        try:
            return memoryview(pa.memory_map(str(self._path(key))).read_buffer())
        except FileNotFoundError:
            raise MissingObject(f"no object {self.uri(key)}") from None

    def get_file(self, key: str, destination: Path) -> None:
        try:
            with atomic_file(destination) as handle, self._path(key).open("rb") as reader:
                shutil.copyfileobj(reader, handle, CHUNK)
        except FileNotFoundError:
            raise MissingObject(f"no object {self.uri(key)}") from None

    def copy(self, source: str, key: str) -> str:
        try:
            return self.put_file(key, self._path(source))
        except FileNotFoundError:
            raise MissingObject(f"no object {self.uri(source)}") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def list_keys(self, prefix: str) -> Iterator[str]:
        base = self._path(prefix)
        if base.is_file():
            yield prefix
            return
        for path in sorted(base.rglob("*")):
            if path.is_file() and not _partial(path):
                yield path.relative_to(self.root).as_posix()

    def uri(self, key: str) -> str:
        return self._path(key).as_uri()

    def link(self, key: str, *, expires_seconds: int) -> str:
        """What a browser opens: the file itself."""
        return self.uri(key)

    def check(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def ensure(self) -> bool:
        """Makes the root folder; True when it was not there."""
        made = not self.root.exists()
        self.check()
        return made
