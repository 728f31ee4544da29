"""A run's held-out samples as evaluation reads them: their latents and text embeddings
from the run's latent shards, and their real images from the image shards they were
encoded from, each shard read once. No torch here."""

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sdq.models.evaluate.specs import HeldOut
from sdq.models.store import ObjectStore
from sdq.workers.shards.images import read_image_shard
from sdq.workers.shards.latents import read_training_tensors


@dataclass(frozen=True)
class HeldOutSamples:
    """Held-out samples as training would read them (workers/evaluate/held_out.py)."""

    keys: list[str]
    captions: list[str]
    # Each sample's tensors by name, as training reads them (read_training_tensors): a run
    # on aspect-ratio buckets holds out samples of several shapes.
    tensors: list[dict[str, np.ndarray]]


def _manifest(store: ObjectStore, held_out: HeldOut) -> dict[str, list]:
    return pq.read_table(pa.BufferReader(store.get_bytes(held_out.key))).to_pydict()


def read_held_out(store: ObjectStore, held_out: HeldOut) -> HeldOutSamples:
    """The held-out samples in the manifest's order."""
    manifest = _manifest(store, held_out)
    places = defaultdict(list)  # latent shard -> [(place in the manifest, row)]
    for place, (key, row) in enumerate(zip(manifest["latent_key"], manifest["row"], strict=True)):
        places[key].append((place, row))
    tensors: list[dict[str, np.ndarray]] = [{} for _ in manifest["row"]]
    for key, wanted in places.items():
        shard = read_training_tensors(store.get_large(key))
        for place, row in wanted:
            tensors[place] = {name: array[row] for name, array in shard.items()}
    return HeldOutSamples(keys=manifest["key"], captions=manifest["caption"], tensors=tensors)


def real_images(store: ObjectStore, held_out: HeldOut) -> list[bytes]:
    """The held-out samples' images as they were downloaded, in the manifest's order."""
    manifest = _manifest(store, held_out)
    shards = dict(zip(manifest["image_key"], manifest["image_format"], strict=True))
    images: dict[str, bytes] = {}
    for key, image_format in shards.items():
        shard = read_image_shard(store.get_bytes(key), image_format)
        images.update(zip(shard.keys, shard.images, strict=True))
    return [images[key] for key in manifest["key"]]
