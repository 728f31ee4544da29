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
    latents: np.ndarray  # samples x channels x height x width, as stored
    text_embeddings: np.ndarray  # samples x tokens x hidden size, as stored
    added: dict[str, np.ndarray]  # an SDXL U-Net's added conditions, by name (none for SD)


def _manifest(store: ObjectStore, held_out: HeldOut) -> dict[str, list]:
    return pq.read_table(pa.BufferReader(store.get_bytes(held_out.key))).to_pydict()


def read_held_out(store: ObjectStore, held_out: HeldOut) -> HeldOutSamples:
    """The held-out samples in the manifest's order."""
    manifest = _manifest(store, held_out)
    places = defaultdict(list)  # latent shard -> [(place in the manifest, row)]
    for place, (key, row) in enumerate(zip(manifest["latent_key"], manifest["row"], strict=True)):
        places[key].append((place, row))
    samples: list[dict[str, np.ndarray]] = [{}] * len(manifest["row"])
    for key, wanted in places.items():
        tensors = read_training_tensors(store.get_large(key))
        for place, row in wanted:
            samples[place] = {name: array[row] for name, array in tensors.items()}
    stacked = {name: np.stack([sample[name] for sample in samples]) for name in samples[0]}
    return HeldOutSamples(
        keys=manifest["key"],
        captions=manifest["caption"],
        latents=stacked.pop("latents"),
        text_embeddings=stacked.pop("text_embeddings"),
        added=stacked,
    )


def real_images(store: ObjectStore, held_out: HeldOut) -> list[bytes]:
    """The held-out samples' images as they were downloaded, in the manifest's order."""
    manifest = _manifest(store, held_out)
    shards = dict(zip(manifest["image_key"], manifest["image_format"], strict=True))
    images: dict[str, bytes] = {}
    for key, image_format in shards.items():
        shard = read_image_shard(store.get_bytes(key), image_format)
        images.update(zip(shard.keys, shard.images, strict=True))
    return [images[key] for key in manifest["key"]]
