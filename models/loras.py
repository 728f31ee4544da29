"""LoRA weights applied at render time (`--lora FILE|s3://...|NAME[:SCALE]`), and pushing a
LoRA file to the registry. No torch here: the producer side checks and names them.

A LoRA is named by its file's content (sha256), so an image's spec hash changes with the
weights and the scale, never with the path or name it was found under."""

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from sdq.models.jobs.kinds import MadeModel
from sdq.models.registry import (
    LORA_FORMAT,
    PATH_PREFIXES,
    STORE_SOURCE,
    ModelNotFound,
    file_sha256,
    latest_pushed,
    made_by_a_run,
    record_lora,
)
from sdq.models.store import ObjectStore, S3Store

SUFFIX = ".safetensors"
# safetensors files start with the length of their JSON header, 8 bytes little-endian.
LENGTH_BYTES = 8
# safetensors' own bound on a header; past it the file is not one.
MAX_HEADER_BYTES = 100 << 20


def parse_lora(value: str) -> tuple[str, float]:
    """`REF[:SCALE]` as (REF, SCALE); a REF with a colon of its own (s3://...) keeps it,
    the part after the last colon is a scale only when it reads as one."""
    ref, colon, tail = value.rpartition(":")
    try:
        scale = float(tail) if colon and ref else None
    except ValueError:
        scale = None
    if scale is None:
        return value, 1.0
    if not math.isfinite(scale):
        raise ModelNotFound(f"LoRA {value!r}: the scale must be a finite number")
    return ref, scale


def resolve_lora(value: str, *, session: Session) -> dict[str, Any]:
    """The spec's record of a `--lora` value: the name, where the file is, its content and
    its scale. A file that is not a LoRA in safetensors format is refused by name."""
    ref, scale = parse_lora(value)
    if ref.startswith("s3://"):
        bucket, _, key = ref.removeprefix("s3://").partition("/")
        data = S3Store(bucket).get_bytes(key)
        check_lora(data[: _header_end(data[:LENGTH_BYTES], ref)], ref)
        sha256, name, source = hashlib.sha256(data).hexdigest(), Path(key).stem, ref
    elif Path(ref).is_file():
        path = Path(ref)
        check_lora(_head(path), str(path))
        sha256, name, source = file_sha256(path), path.stem, str(path.resolve())
    elif (made := made_by_a_run(session, ref)) is not None:
        if made.lora_key is None:
            raise ModelNotFound(f"{ref!r} is a pipeline a train run made: pass it with --model")
        sha256, name, source = made.revision, made.name, f"{STORE_SOURCE}{made.lora_key}"
    elif (record := latest_pushed(session, ref, LORA_FORMAT)) is not None:
        sha256, name, source = record.revision, ref, f"{STORE_SOURCE}{record.store_prefix}"
    elif ref.startswith(PATH_PREFIXES) or ref.endswith(SUFFIX):
        raise ModelNotFound(f"no LoRA file {ref} ({Path(ref).expanduser().absolute()})")
    elif latest_pushed(session, ref) is not None:
        raise ModelNotFound(f"{ref!r} is a pipeline, not a LoRA: pass it with --model")
    else:
        raise ModelNotFound(
            f"unknown LoRA {ref!r}: not a .safetensors file, an s3:// URI, "
            f"or a name registered with `sdq model push FILE NAME`{_not_a_scale(ref)}"
        )
    return lora_record(name, source, sha256, scale)


def _not_a_scale(ref: str) -> str:
    """Why NAME:SCALE read as a name: what follows its last colon is not a number."""
    name, _, tail = ref.rpartition(":")  # no colon: no name either
    return f"; {name!r} with a scale is {name}:NUMBER, and {tail!r} is none" if name else ""


def lora_record(name: str, source: str, sha256: str, scale: float = 1.0) -> dict[str, Any]:
    """What a spec records of a LoRA: its name, where its file is, its content and scale."""
    return {"name": name, "source": source, "sha256": sha256, "scale": scale}


def check_lora(head: bytes, where: str) -> None:
    """Refuses a file whose safetensors header names no LoRA weights (diffusers' and
    kohya's formats both name theirs lora_*)."""
    try:
        names = json.loads(head[LENGTH_BYTES:])
    except ValueError:
        names = None
    if not isinstance(names, dict):
        raise ModelNotFound(f"{where} is not a safetensors file: its header does not read")
    if not any("lora" in name.lower() for name in names if name != "__metadata__"):
        raise ModelNotFound(f"{where} holds no LoRA weights (no tensor named lora_*)")


def _head(path: Path) -> bytes:
    """A safetensors file's length prefix and header."""
    with path.open("rb") as handle:
        end = _header_end(handle.read(LENGTH_BYTES), str(path))
        handle.seek(0)
        return handle.read(end)


def _header_end(prefix: bytes, where: str) -> int:
    length = int.from_bytes(prefix, "little") if len(prefix) == LENGTH_BYTES else 0
    if not 0 < length <= MAX_HEADER_BYTES:
        raise ModelNotFound(f"{where} is not a safetensors file: no header")
    return LENGTH_BYTES + length


@dataclass(frozen=True)
class PushedLora:
    sha256: str
    key: str
    uploaded: bool  # False: this file was in the store already


def push_lora(path: Path, name: str, *, store: ObjectStore, session: Session) -> PushedLora:
    """Copies a LoRA file into the store once per content; the registry row, written
    last, marks the copy complete."""
    if path.suffix != SUFFIX:
        raise ModelNotFound(f"{path}: a LoRA is pushed as a {SUFFIX} file")
    check_lora(_head(path), str(path))
    return _push(name, file_sha256(path), lambda key: store.put_file(key, path), session)


def push_made_lora(
    made: MadeModel, name: str, *, store: ObjectStore, session: Session
) -> PushedLora:
    """The LoRA file a train run made, copied within the store under `name`, so that the
    keep policy deleting the run's old checkpoints leaves it; its content, so its lineage,
    stays the checkpoint's."""
    return _push(name, made.revision, lambda key: store.copy(made.lora_key, key), session)


def _push(name: str, sha256: str, put: Callable[[str], None], session: Session) -> PushedLora:
    """`put` the file at its key once per content; the registry row, written last, marks
    the copy complete."""
    key = f"loras/{name}/{sha256[:16]}{SUFFIX}"
    known = latest_pushed(session, name, LORA_FORMAT)
    if known is not None and known.revision == sha256:
        return PushedLora(sha256, key, uploaded=False)
    put(key)
    record_lora(session, name, key, sha256)
    return PushedLora(sha256, key, uploaded=True)
