"""Where a model's files are on this worker, for every kind that loads weights: a hub id
as it is, a local folder, or a stored or s3:// model copied to local disk once per
revision. No torch here: the loaders that use it import that themselves."""

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sdq.models import registry, tiny
from sdq.models.store import ObjectStore, S3Store


class PipelineError(Exception):
    """A model cannot be loaded or run as a spec asks; retrying will not change that."""


class ModelUnavailable(Exception):
    """The model cannot be had on this worker as the job names it; retrying will not help."""


# What the file that names a folder's contents says it is.
MARKED = {registry.MODEL_INDEX: "a diffusers pipeline", "config.json": "a transformers model"}


@dataclass(frozen=True)
class Location:
    """What diffusers' and transformers' `from_pretrained` take: a hub id at a commit, or
    a local folder (revision None)."""

    path: str
    revision: str | None = None


@dataclass(frozen=True)
class ModelFiles:
    store: ObjectStore
    cache_dir: Path

    def locate(self, source: str, revision: str, marker: str = registry.MODEL_INDEX) -> Location:
        """Where the model's files are: `marker` names the file that says what they are
        (a diffusers pipeline's model_index.json, a transformers model's config.json)."""
        if source.startswith(registry.HUB_SOURCE):
            return Location(source.removeprefix(registry.HUB_SOURCE), revision)
        if source.startswith("s3://"):
            folder = self._pull(S3Store.from_uri(source), "", revision)
        elif source.startswith(registry.STORE_SOURCE):
            prefix = source.removeprefix(registry.STORE_SOURCE)
            folder = self._pull(self.store, f"{prefix}/", revision)
        else:
            folder = Path(source)
            if not folder.is_dir():
                raise ModelUnavailable(f"model folder {source} does not exist on this worker")
        if not (folder / marker).is_file():
            # The loader would fail on it with an error that another attempt cannot mend.
            what = MARKED.get(marker, "a model")
            raise ModelUnavailable(f"model folder {source} is not {what}: no {marker}")
        return Location(str(folder))

    def lora_file(self, source: str, sha256: str) -> Path:
        """A LoRA's file as the spec names it (models/loras.py)."""
        return self.content_file(source, sha256, what="LoRA", suffix=".safetensors")

    def content_file(self, source: str, sha256: str, *, what: str, suffix: str) -> Path:
        """A file a spec names by its content (a LoRA, FID's Inception weights): a stored or
        s3:// one copied here once per content, a local one checked to be the content the
        job was made for."""
        if source.startswith(registry.STORE_SOURCE):
            key = source.removeprefix(registry.STORE_SOURCE)
            return self._pull_file(self.store, key, sha256, what, suffix)
        if source.startswith("s3://"):
            bucket, _, key = source.removeprefix("s3://").partition("/")
            return self._pull_file(S3Store(bucket), key, sha256, what, suffix)
        path = Path(source)
        if not path.is_file():
            raise ModelUnavailable(f"{what} file {source} does not exist on this worker")
        if registry.file_sha256(path) != sha256:
            raise ModelUnavailable(f"{what} file {source} is not the one the job was made for")
        return path

    def _pull_file(self, store: ObjectStore, key: str, sha256: str, what: str, suffix: str) -> Path:
        path = self.cache_dir / "files" / f"{sha256}{suffix}"
        if path.is_file():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        store.get_file(key, partial)
        if registry.file_sha256(partial) != sha256:
            partial.unlink()
            raise ModelUnavailable(f"{what} {store.uri(key)} changed since the job was made")
        os.replace(partial, path)  # another process may have finished first: the same bytes
        return path

    def _pull(self, store: ObjectStore, prefix: str, revision: str) -> Path:
        """Copies a stored model to local disk once per machine, keyed by its revision."""
        folder = self.cache_dir / revision
        if folder.is_dir():
            return folder
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(dir=self.cache_dir, prefix=f".{revision}."))
        try:
            for key in store.list_keys(prefix):
                store.get_file(key, partial / key.removeprefix(prefix))
            # Another process on this machine may have finished first; both copies are equal.
            os.rename(partial, folder)
        except OSError:
            if not folder.is_dir():
                raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return folder


def check_tiny_revision(revision: str, built: str | None = None) -> None:
    """The tiny model (or the tiny CLIP, `built`) is built from code: a job made for another
    version of that code would get different weights under the revision it names."""
    built = built or tiny.content_hash()
    if revision != built:
        raise ModelUnavailable(
            f"this worker's tiny model is revision {built[:12]}, the job asks for {revision[:12]}"
        )
