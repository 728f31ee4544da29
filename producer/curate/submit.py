"""Writing a curate run: one job per downloaded image shard of the dataset, scored by one
CLIP model and the heads given. A shard scored so already (the same file, model revision
and heads) is served from the store, as images are."""

import json
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from sdq.models import tiny
from sdq.models.curate.clip import ClipIdentity
from sdq.models.curate.specs import HEAD_LAYER, CurateSpec, head_key
from sdq.models.datasets import derived_from
from sdq.models.datasets.tables import Dataset, Shard
from sdq.models.jobs.kinds import CURATE
from sdq.models.jobs.outbox import add_jobs, open_run
from sdq.models.registry import file_sha256
from sdq.models.store import ObjectStore
from sdq.producer.datasets.lookups import downloaded_shards

HEAD_READER = "sdq.workers.curate.heads"
# LAION's improved aesthetic predictor after the embedding: Linear(D, 1024), Linear(1024,
# 128), Linear(128, 64), Linear(64, 16), Linear(16, 1). Another stack (an NSFW head given
# by mistake) would score on another scale, and its scores replace the dataset's.
AESTHETIC_LAYOUT = [1024, 128, 64, 16, 1]
SAFETENSORS = ".safetensors"
# `--aesthetic-head tiny`, `--nsfw-head tiny`: heads built here for whatever CLIP model is
# given (its embedding's width, then these), each from a stream of the tiny seed of its own.
TINY_HEADS = {"--aesthetic-head": (AESTHETIC_LAYOUT, 1), "--nsfw-head": ([64, 1], 2)}


class CannotCurate(Exception):
    pass


@dataclass(frozen=True)
class CurateSubmission:
    run_id: int
    dataset: str
    model: str
    revision: str
    jobs: int
    cached: int
    waiting: int  # shards planned but not downloaded yet: a later `sdq curate` takes them


@dataclass(frozen=True)
class Heads:
    """The heads' files in the store (their keys), or None where none was given."""

    aesthetic: str | None = None
    nsfw: str | None = None


def tiny_head(option: str, clip: ClipIdentity, folder: Path) -> Path:
    """The tiny head `option` takes, for `clip`, written in `folder`: random weights built
    here, so that curate runs the chain without a download (its scores mean nothing)."""
    layout, stream = TINY_HEADS[option]
    path = folder / f"tiny{option.removesuffix('-head')}{SAFETENSORS}"
    path.write_bytes(tiny.head_file([clip.embedding_width, *layout], stream))
    return path


def checked_head(path: Path, option: str, clip: ClipIdentity) -> list[int]:
    """The head's layer widths, refused when it is not a stack of linear layers ending in
    one output, or does not take the CLIP model's embedding."""
    widths = head_widths(path, option)
    if option == "--aesthetic-head" and widths[1:] != AESTHETIC_LAYOUT:
        raise CannotCurate(
            f"{option} {path}: layers of widths {' -> '.join(map(str, widths))}, not LAION's "
            f"aesthetic predictor (D -> {' -> '.join(map(str, AESTHETIC_LAYOUT))}); is it "
            "another head?"
        )
    if widths[0] != clip.embedding_width:
        raise CannotCurate(
            f"{option} {path}: the head takes {widths[0]}-wide embeddings; CLIP model "
            f"{clip.name} makes {clip.embedding_width}-wide ones"
        )
    return widths


def head_widths(path: Path, option: str) -> list[int]:
    """Each layer's input width and the last one's output width: from a safetensors file's
    header here, from a torch file in a child process (the CLI itself never loads torch)."""
    if path.suffix == SAFETENSORS:
        return _safetensors_widths(path, option)
    done = subprocess.run([sys.executable, "-m", HEAD_READER, str(path)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise CannotCurate(
            f"{option} {path}: cannot read it as a torch state dict "
            f"(torch is needed here for a {path.suffix} head): {last}"
        ) from None
    if "error" in answer:
        raise CannotCurate(f"{option} {answer['error']}")
    return answer["widths"]


def _safetensors_widths(path: Path, option: str) -> list[int]:
    try:
        with path.open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        tensors = {key: value["shape"] for key, value in header.items() if key != "__metadata__"}
    except (OSError, struct.error, ValueError, TypeError, KeyError) as error:
        raise CannotCurate(f"{option} {path}: not a safetensors file ({error!r})") from None
    others = sorted(key for key in tensors if not HEAD_LAYER.fullmatch(key))
    if others or not tensors:
        named = f"it has {', '.join(others[:4])}{', ...' * (len(others) > 4)}"
        raise CannotCurate(f"{option} {path}: not a head of linear layers keyed layers.<i>.weight "
                           f"and .bias ({named if others else 'it has no tensors'})")  # fmt: skip
    indices = sorted({int(HEAD_LAYER.fullmatch(key)[1]) for key in tensors})
    shapes = [tensors.get(f"layers.{index}.weight", []) for index in indices]
    if not shapes or any(len(shape) != 2 for shape in shapes) or shapes[-1][0] != 1:
        raise CannotCurate(f"{option} {path}: not a stack of linear layers ending in one output")
    return [shape[1] for shape in shapes] + [1]


def store_head(store: ObjectStore, path: Path) -> str:
    """The head's file in the store, named by its content (stored once)."""
    key = head_key(file_sha256(path), path.suffix)
    if not store.exists(key):
        store.put_file(key, path)
    return key


def curatable(session: Session, name: str) -> tuple[Dataset, list[Shard], int]:
    """The dataset's downloaded shards (see downloaded_shards); a dataset made of another's
    samples is refused: its samples carry the scores of the one that downloaded them."""
    dataset, shards, waiting = downloaded_shards(session, name)
    if origin := derived_from(dataset.options):
        raise CannotCurate(f"dataset {name!r} is made of {origin!r}'s samples and shares "
                           f"their scores: curate {origin!r}")  # fmt: skip
    return dataset, shards, waiting


def record_curate(
    sessions: sessionmaker[Session], name: str, clip: ClipIdentity, heads: Heads, batch_size: int
) -> CurateSubmission:
    """The curate run and its jobs, one per downloaded shard, in one transaction."""
    with sessions.begin() as session:
        dataset, shards, waiting = curatable(session, name)
        run = open_run(
            session,
            CURATE,
            source=name,
            options={
                "dataset": name,
                "model": clip.name,
                "revision": clip.revision,
                "aesthetic_head": heads.aesthetic,
                "nsfw_head": heads.nsfw,
            },
            jobs_per_message=1,  # a shard is a minute of GPU work: one per message
            task_options={"batch_size": batch_size},
        )
        specs = [_spec(dataset, shard, clip, heads) for shard in shards]
        cached = add_jobs(session, run, CURATE, specs)
    return CurateSubmission(run.id, name, clip.name, clip.revision, len(specs), cached, waiting)


def _spec(dataset: Dataset, shard: Shard, clip: ClipIdentity, heads: Heads) -> CurateSpec:
    return CurateSpec(
        dataset=dataset.name,
        shard=shard.number,
        shard_sha256=shard.sha256,
        image_format=dataset.options["format"],
        model_name=clip.name,
        model_source=clip.source,
        model_revision=clip.revision,
        aesthetic_head=heads.aesthetic,
        nsfw_head=heads.nsfw,
    )
