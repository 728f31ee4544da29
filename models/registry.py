"""Resolving `--model` to an exact identity, and the registry of pushed models.

Runs on the producer side: no torch here. A model is identified by what it is (a content
hash, or a hub commit), so the spec hash of an image changes when the weights change.
"""

import difflib
import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from sdq.models import tiny
from sdq.models.db import upsert
from sdq.models.jobs.kinds import KINDS, MadeModel
from sdq.models.specs import AUTO_DTYPE, ModelIdentity
from sdq.models.store import MissingObject, ObjectStore, S3Store
from sdq.models.tables import ModelRecord

SCHEDULER_CONFIG_FILE = "scheduler/scheduler_config.json"
MODEL_INDEX = "model_index.json"
# What makes a model's latents and text embeddings: the rest of it does not change them
# (SDXL has a second text encoder and tokenizer).
ENCODER_FOLDERS = ("vae/", "text_encoder/", "tokenizer/", "text_encoder_2/", "tokenizer_2/")
# A model named like a path is a folder, never a hub id: if it is not there, say so.
PATH_PREFIXES = ("./", "../", "/", "~", ".\\")
UNET_CONFIG_FILE = "unet/config.json"
STORE_SOURCE = "store:"
# A training checkpoint: the run id or its `--into` name, then the step.
HUB_SOURCE = "hub:"
# What a registry record is (ModelRecord.format).
PIPELINE_FORMAT = "pipeline"
LORA_FORMAT = "lora"


class ModelNotFound(Exception):
    """`--model` names nothing sdq can load."""


def tiny_identity() -> ModelIdentity:
    return ModelIdentity(
        name=tiny.TINY_NAME,
        source=tiny.TINY_NAME,
        revision=tiny.content_hash(),
        scheduler=tiny.SCHEDULER_CLASS,
        scheduler_config=tiny.SCHEDULER_CONFIG,
        default_dtype="float32",
        default_size=tiny.UNET_CONFIG["sample_size"] * 8,
        encoders_hash=tiny.encoders_hash(),
    )


def content_hash(entries: Iterable[tuple[str, str]]) -> str:
    """Hash of a pipeline's files: sorted (relative path, file digest) pairs."""
    digest = hashlib.sha256()
    for path, file_digest in sorted(entries):
        digest.update(f"{path}\0{file_digest}\n".encode())
    return digest.hexdigest()


def pipeline_files(folder: Path) -> list[Path]:
    return sorted(
        path
        for path in folder.rglob("*")
        if path.is_file()
        and not any(part.startswith(".") for part in path.relative_to(folder).parts)
    )


def folder_content_hash(folder: Path) -> str:
    return folder_hashes(folder)[0]


def folder_hashes(folder: Path) -> tuple[str, str]:
    """A pipeline folder's content hash, and that of its encoders' files alone."""
    entries = [
        (path.relative_to(folder).as_posix(), file_sha256(path)) for path in pipeline_files(folder)
    ]
    encoders = [entry for entry in entries if entry[0].startswith(ENCODER_FOLDERS)]
    return content_hash(entries), content_hash(encoders)


def file_sha256(path: Path) -> str:
    """A file's sha256, read a block at a time."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def scheduler_from_config(raw: bytes, where: str) -> tuple[str, dict[str, Any]]:
    try:
        config = json.loads(raw)
        name = config["_class_name"]
    except (ValueError, KeyError) as error:
        raise ModelNotFound(f"{where} is not a diffusers scheduler config: {error}") from None
    return name, {key: value for key, value in config.items() if not key.startswith("_")}


def resolve_model(ref: str, *, store: ObjectStore, session: Session) -> ModelIdentity:
    """`tiny`, a local diffusers folder, an s3:// URI, a training checkpoint (RUN@STEP or
    NAME@STEP), a pushed or trained name (its newest revision), or a hub id."""
    if ref == tiny.TINY_NAME:
        return tiny_identity()
    if (files := stored_files(ref)) is not None:
        return _pipeline(files)
    if (made := made_by_a_run(session, ref)) is not None:
        if made.lora_key is not None:
            raise ModelNotFound(f"{ref!r} is a LoRA a train run made, not a pipeline: a render "
                                f"takes it with --lora {ref} over its base")  # fmt: skip
        return _made_identity(made, store)
    if (record := latest_pushed(session, ref)) is not None:
        return _resolve_pushed(record, store)
    if is_hub_id(ref):
        return _identity(hub_files(ref))
    if latest_pushed(session, ref, LORA_FORMAT) is not None:
        raise ModelNotFound(f"{ref!r} is a LoRA, not a pipeline: a render takes it with "
                            f"--lora {ref} over its base")  # fmt: skip
    raise ModelNotFound(
        f"unknown model {ref!r}{_did_you_mean(session, ref)}: not 'tiny', a local folder, an "
        "s3:// URI, a name registered with `sdq model push` or by training, or a hub id like "
        "org/name"
    )


def _did_you_mean(session: Session, ref: str) -> str:
    """` (did you mean 'tiny'?)` for a misspelt name of a model sdq knows, else nothing."""
    names = session.scalars(
        select(ModelRecord.name).where(ModelRecord.format == PIPELINE_FORMAT).distinct()
    )
    close = difflib.get_close_matches(ref, [tiny.TINY_NAME, *names], n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


@dataclass(frozen=True)
class FoundModel:
    """Where a model's files are, what its revision is, and a reader of its files by
    relative name (None for a file it does not have)."""

    name: str
    source: str  # /local/folder | s3://bucket/prefix | hub:<id> | store:<prefix>
    revision: str  # content hash or hub commit
    read: Callable[[str], bytes | None]
    encoders_hash: str | None = None
    local: bool = False
    made_by: tuple[int, int] | None = None  # a checkpoint's run and step


def stored_files(ref: str) -> FoundModel | None:
    """A model's files in an s3:// URI or a local folder; None for a ref that is neither
    (a name, a hub id). A path to no folder is refused by name."""
    if ref.startswith("s3://"):
        store = S3Store.from_uri(ref)
        listing = store.object_digests("")
        if not listing:
            raise ModelNotFound(f"no objects under {ref}")
        name = store.prefix.rsplit("/", 1)[-1] or store.bucket
        return FoundModel(name, ref, content_hash(listing.items()), _store_reader(store, ""))
    if Path(ref).is_dir():
        folder = Path(ref)

        def read(relative: str) -> bytes | None:
            path = folder / relative
            return path.read_bytes() if path.is_file() else None

        revision, encoders = folder_hashes(folder)
        return FoundModel(folder.name, str(folder.resolve()), revision, read, encoders, local=True)
    if ref.startswith(PATH_PREFIXES):
        raise ModelNotFound(f"no folder {ref} ({Path(ref).expanduser().absolute()})")
    return None


def is_hub_id(ref: str) -> bool:
    return ref.startswith(HUB_SOURCE) or ref.count("/") == 1


def hub_files(ref: str) -> FoundModel:
    """A hub id pinned to its current commit, so later work loads exactly these weights."""
    repo_id, _, revision = ref.removeprefix(HUB_SOURCE).partition("@")
    try:
        from huggingface_hub import HfApi, hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        commit = HfApi().model_info(repo_id, revision=revision or None).sha
    except ImportError:
        raise ModelNotFound(
            f"{ref!r} looks like a hub id; install sdq[gpu] to resolve it"
        ) from None
    except Exception as error:  # the hub library raises many kinds; all mean "cannot use it"
        raise ModelNotFound(f"cannot resolve hub model {ref!r}: {error}") from None

    def read(relative: str) -> bytes | None:
        try:
            return Path(hf_hub_download(repo_id, relative, revision=commit)).read_bytes()
        except EntryNotFoundError:
            return None

    return FoundModel(repo_id, f"{HUB_SOURCE}{repo_id}", commit, read)


def _pipeline(files: FoundModel) -> ModelIdentity:
    """A folder or copy's identity, refused when it is not a diffusers pipeline."""
    if files.local and files.read(MODEL_INDEX) is None:
        raise ModelNotFound(f"{files.source} is not a diffusers pipeline: no {MODEL_INDEX}")
    return _identity(files)


def _identity(files: FoundModel) -> ModelIdentity:
    """Completes an identity from the pipeline's own config files."""
    raw = files.read(SCHEDULER_CONFIG_FILE)
    if raw is None:
        raise ModelNotFound(
            f"{files.source} is not a diffusers pipeline: no {SCHEDULER_CONFIG_FILE}"
        )
    where = f"{files.source}/{SCHEDULER_CONFIG_FILE}"
    scheduler, scheduler_config = scheduler_from_config(raw, where)
    return ModelIdentity(
        name=files.name,
        source=files.source,
        revision=files.revision,
        scheduler=scheduler,
        scheduler_config=scheduler_config,
        default_dtype=AUTO_DTYPE,
        default_size=_native_size(files.read(UNET_CONFIG_FILE)),
        encoders_hash=files.encoders_hash,
        made_by=files.made_by,
    )


def _native_size(unet_config: bytes | None) -> int:
    """The size a model was trained at: its U-Net's latent size times the VAE's factor 8."""
    try:
        return int(json.loads(unet_config)["sample_size"]) * 8 if unet_config else 512
    except (ValueError, KeyError, TypeError):
        return 512


def made_by_a_run(session: Session, ref: str) -> MadeModel | None:
    """A model a run made (a training checkpoint, RUN@STEP, NAME@STEP or RUN@best:METRIC),
    from the kind whose runs make models (its `made_model` hook); ModelNotFound for one of
    a known run that is not there (deleted, or never written as a model)."""
    for kind in KINDS.values():
        made_model = kind.model_hooks().made_model
        if made_model is not None and (made := made_model(session, ref)) is not None:
            return made
    return None


def _made_identity(made: MadeModel, store: ObjectStore) -> ModelIdentity:
    return _identity(FoundModel(made.name, f"{STORE_SOURCE}{made.prefix}", made.revision,
                                _store_reader(store, f"{made.prefix}/"),
                                made_by=(made.run, made.step)))  # fmt: skip


def _resolve_pushed(record: ModelRecord, store: ObjectStore) -> ModelIdentity:
    return _identity(FoundModel(record.name, f"{STORE_SOURCE}{record.store_prefix}",
                                record.revision, _store_reader(store, f"{record.store_prefix}/"),
                                record.encoders_hash))  # fmt: skip


def _store_reader(store: ObjectStore, prefix: str) -> Callable[[str], bytes | None]:
    def read(relative: str) -> bytes | None:
        try:
            return store.get_bytes(f"{prefix}{relative}")
        except MissingObject:
            return None

    return read


def latest_pushed(session: Session, name: str, format: str = PIPELINE_FORMAT) -> ModelRecord | None:
    """The newest copy in the store of the pipeline (or LoRA) registered as `name`."""
    return session.scalars(
        select(ModelRecord)
        .where(
            ModelRecord.name == name,
            ModelRecord.store_prefix.is_not(None),
            ModelRecord.format == format,
        )
        .order_by(ModelRecord.id.desc())
        .limit(1)
    ).first()


def record_model(
    session: Session, identity: ModelIdentity, store_prefix: str | None = None
) -> None:
    """Adds the identity to the registry unless it is there; safe under concurrent submits."""
    _record(
        session,
        identity.name,
        identity.source,
        identity.revision,
        store_prefix,
        encoders_hash=identity.encoders_hash,
    )


def record_stored_model(session: Session, name: str, prefix: str, revision: str) -> None:
    """Registers a pipeline folder in the store under a name: `--model NAME` is then its
    newest revision (a push, or a training checkpoint)."""
    _record(session, name, f"{STORE_SOURCE}{prefix}", revision, prefix)


def record_lora(session: Session, name: str, key: str, sha256: str) -> None:
    """Registers a LoRA file in the store under a name: `--lora NAME` is then its newest."""
    _record(session, name, f"{STORE_SOURCE}{key}", sha256, key, format=LORA_FORMAT)


def _record(
    session: Session,
    name: str,
    source: str,
    revision: str,
    store_prefix: str | None,
    *,
    encoders_hash: str | None = None,
    format: str = PIPELINE_FORMAT,
) -> None:
    statement = upsert(session, ModelRecord).values(
        name=name,
        source=source,
        revision=revision,
        store_prefix=store_prefix,
        encoders_hash=encoders_hash,
        format=format,
    )
    key = [ModelRecord.name, ModelRecord.revision]
    known = {"encoders_hash": func.coalesce(statement.excluded.encoders_hash,
                                            ModelRecord.encoders_hash)}  # fmt: skip
    if store_prefix:
        known["store_prefix"] = store_prefix
    session.execute(statement.on_conflict_do_update(index_elements=key, set_=known))


def same_encoders(session: Session, identity: ModelIdentity) -> list[str]:
    """Revisions of the registered models whose VAE, text encoder and tokenizer files are
    the identity's, byte for byte."""
    if identity.encoders_hash is None:
        return []
    return list(
        session.scalars(
            select(ModelRecord.revision)
            .where(ModelRecord.encoders_hash == identity.encoders_hash)
            .distinct()
        )
    )


@dataclass(frozen=True)
class Pushed:
    identity: ModelIdentity
    prefix: str
    uploaded: bool  # False: this revision was in the store already


def push_model(folder: Path, name: str, *, store: ObjectStore, session: Session) -> Pushed:
    """A pipeline folder copied into the store under `name`."""
    if (files := stored_files(str(folder))) is None or not files.local:
        raise ModelNotFound(f"no folder {folder}")

    def put_files(prefix: str) -> None:
        for path in pipeline_files(folder):
            store.put_file(f"{prefix}/{path.relative_to(folder).as_posix()}", path)

    return _push(_pipeline(files), name, session, put_files)


def push_made_model(made: MadeModel, name: str, *, store: ObjectStore, session: Session) -> Pushed:
    """The pipeline a run made, copied within the store under `name`, so that the keep
    policy deleting the run's old checkpoints leaves it. Its revision, so its lineage, stays
    the checkpoint's."""

    def copy_files(prefix: str) -> None:
        for key in store.list_keys(f"{made.prefix}/"):
            store.copy(key, f"{prefix}/{key.removeprefix(f'{made.prefix}/')}")

    return _push(_made_identity(made, store), name, session, copy_files)


def _push(
    identity: ModelIdentity, name: str, session: Session, put_files: Callable[[str], None]
) -> Pushed:
    """Puts a model's files in the store once per revision (`put_files` given the prefix);
    the registry row, written last, marks the copy complete."""
    prefix = f"models/{name}/{identity.revision[:16]}"
    pushed = replace(identity, name=name, source=f"{STORE_SOURCE}{prefix}")
    known = latest_pushed(session, name)
    if known is not None and known.revision == identity.revision:
        return Pushed(pushed, prefix, uploaded=False)
    put_files(prefix)
    record_model(session, pushed, store_prefix=prefix)
    return Pushed(pushed, prefix, uploaded=True)
