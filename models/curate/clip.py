"""A CLIP model as curate names it: a transformers CLIPModel folder, an s3:// copy of one,
or a hub id (pinned to its commit), with the figures a head must fit. No torch here."""

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sdq.models.registry import (
    HUB_SOURCE,
    PATH_PREFIXES,
    ModelNotFound,
    content_hash,
    file_sha256,
    pipeline_files,
)
from sdq.models.store import MissingObject, S3Store

CONFIG_FILE = "config.json"


@dataclass(frozen=True, kw_only=True)
class ClipIdentity:
    name: str
    source: str  # /local/folder | s3://bucket/prefix | hub:<id>
    revision: str  # content hash or hub commit
    embedding_width: int  # the projection's width: what a head on the embedding takes


def resolve_clip(ref: str) -> ClipIdentity:
    """A local folder, an s3:// URI, or a hub id like openai/clip-vit-large-patch14."""
    if ref.startswith("s3://"):
        store = S3Store.from_uri(ref)
        listing = store.object_digests("")
        if not listing:
            raise ModelNotFound(f"no objects under {ref}")
        name = store.prefix.rsplit("/", 1)[-1] or store.bucket
        return _identity(name, ref, content_hash(listing.items()), _reader(store.get_bytes))
    if Path(ref).is_dir():
        folder = Path(ref)
        entries = [(path.relative_to(folder).as_posix(), file_sha256(path))
                   for path in pipeline_files(folder)]  # fmt: skip
        read = _reader(lambda name: (folder / name).read_bytes(), FileNotFoundError)
        return _identity(folder.name, str(folder.resolve()), content_hash(entries), read)
    if ref.startswith(PATH_PREFIXES):
        raise ModelNotFound(f"no folder {ref} ({Path(ref).expanduser().absolute()})")
    if ref.startswith(HUB_SOURCE) or ref.count("/") == 1:
        return _resolve_hub(ref.removeprefix(HUB_SOURCE))
    raise ModelNotFound(
        f"unknown CLIP model {ref!r}: not a local folder, an s3:// URI or a hub id like "
        "openai/clip-vit-large-patch14"
    )


def _reader(
    get: Callable[[str], bytes], missing: type[Exception] = MissingObject
) -> Callable[[str], bytes | None]:
    def read(name: str) -> bytes | None:
        try:
            return get(name)
        except missing:
            return None

    return read


def _identity(
    name: str, source: str, revision: str, read: Callable[[str], bytes | None]
) -> ClipIdentity:
    raw = read(CONFIG_FILE)
    try:
        config = json.loads(raw) if raw else {}
    except ValueError:
        config = {}
    if config.get("model_type") != "clip" or "projection_dim" not in config:
        raise ModelNotFound(
            f"{source} is not a CLIP model: its {CONFIG_FILE} does not describe a "
            "transformers CLIPModel (model_type 'clip' with a projection_dim)"
        )
    return ClipIdentity(
        name=name, source=source, revision=revision, embedding_width=config["projection_dim"]
    )


def _resolve_hub(ref: str) -> ClipIdentity:
    """Pins a hub id to its current commit, so every shard is scored by the same weights."""
    repo_id, _, revision = ref.partition("@")
    try:
        from huggingface_hub import HfApi, hf_hub_download

        commit = HfApi().model_info(repo_id, revision=revision or None).sha
        config = Path(hf_hub_download(repo_id, CONFIG_FILE, revision=commit)).read_bytes()
    except ImportError:
        needed = f"{ref!r} looks like a hub id; install sdq[gpu] to resolve it"
        raise ModelNotFound(needed) from None
    except Exception as error:  # the hub library raises many kinds; all mean "cannot use it"
        raise ModelNotFound(f"cannot resolve hub model {ref!r}: {error}") from None
    return _identity(repo_id, f"{HUB_SOURCE}{repo_id}", commit, lambda _name: config)
