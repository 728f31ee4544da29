"""CLIP scoring on the device: each image's CLIP embedding, its CLIP score against its
caption, and the heads' scores of the embedding, batch by batch, the images decoded and the
captions tokenized on threads ahead of the device. GPU-side: imports torch."""

import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from transformers import CLIPImageProcessorPil, CLIPModel, CLIPTokenizer

from sdq.models.curate.specs import CurateSpec
from sdq.models.store import ObjectStore
from sdq.workers.curate.heads import aesthetic_head, nsfw_head, read_head
from sdq.workers.gpu import device_name, release_device_memory
from sdq.workers.shards.images import ImageShard
from sdq.workers.shards.pixels import to_rgb
from sdq.workers.weights import ModelFiles

CLIP_CONFIG = "config.json"


@dataclass(frozen=True)
class Scorer:
    model: CLIPModel
    processor: CLIPImageProcessorPil
    tokenizer: CLIPTokenizer
    aesthetic: torch.nn.Module | None
    nsfw: torch.nn.Module | None
    device: torch.device
    dtype: torch.dtype


class LoadedScorers:
    """The CLIP model and heads of the last spec this process scored with: a worker scores
    one dataset shard after shard, and a GPU has no room to spare for a second model."""

    def __init__(self, files: ModelFiles, store: ObjectStore) -> None:
        self.files, self.store = files, store
        self._key: tuple[str, str, str | None, str | None] | None = None
        self._scorer: Scorer | None = None

    def clear(self) -> None:
        self._key, self._scorer = None, None
        release_device_memory()

    def get(self, spec: CurateSpec) -> Scorer:
        key = (spec.model_source, spec.model_revision, spec.aesthetic_head, spec.nsfw_head)
        if key != self._key or self._scorer is None:
            self._scorer = None  # the old weights go before the new ones load
            self._scorer = self._load(spec)
            self._key = key
        return self._scorer

    def _load(self, spec: CurateSpec) -> Scorer:
        where = self.files.locate(spec.model_source, spec.model_revision, marker=CLIP_CONFIG)
        device = torch.device(device_name())
        # Half precision on a GPU; scores are read as float32 either way.
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        model = CLIPModel.from_pretrained(where.path, revision=where.revision, dtype=dtype)
        return Scorer(
            model=model.to(device).eval().requires_grad_(False),
            processor=CLIPImageProcessorPil.from_pretrained(where.path, revision=where.revision),
            tokenizer=CLIPTokenizer.from_pretrained(where.path, revision=where.revision),
            aesthetic=self._head(spec.aesthetic_head, aesthetic_head, device),
            nsfw=self._head(spec.nsfw_head, nsfw_head, device),
            device=device,
            dtype=dtype,
        )

    def _head(self, key: str | None, build, device: torch.device) -> torch.nn.Module | None:
        if key is None:
            return None
        head = build(read_head(self.store.get_bytes(key), key), key)
        return head.to(device, torch.float32).eval().requires_grad_(False)


@dataclass(frozen=True)
class Batch:
    pixels: torch.Tensor  # CLIP's input: resized, cropped and normalised by its processor
    token_ids: torch.Tensor
    attention_mask: torch.Tensor


@dataclass(frozen=True)
class Scores:
    embeddings: np.ndarray  # float16, L2-normalised, one row per image
    clip_score: np.ndarray
    aesthetic: np.ndarray | None
    nsfw: np.ndarray | None


def prepare_batches(
    shard: ImageShard, scorer: Scorer, *, batch_size: int, decoders: ThreadPoolExecutor
) -> Iterator[Batch]:
    """The CPU work, batch by batch: decoding and CLIP's preprocessing on `decoders`
    (Pillow resizes without the GIL), the captions tokenized to CLIP's length."""
    pin = scorer.device.type == "cuda"
    length = scorer.model.config.text_config.max_position_embeddings

    def pixels(data: bytes) -> np.ndarray:
        with Image.open(io.BytesIO(data)) as image:
            return scorer.processor(images=to_rgb(image), return_tensors="np")["pixel_values"][0]

    for start in range(0, len(shard), batch_size):
        stop = start + batch_size
        images = torch.from_numpy(np.stack(list(decoders.map(pixels, shard.images[start:stop]))))
        tokens = scorer.tokenizer(
            [caption or "" for caption in shard.captions[start:stop]],
            padding="max_length", max_length=length, truncation=True, return_tensors="pt",
        )  # fmt: skip
        parts = (images, tokens.input_ids, tokens.attention_mask)
        yield Batch(*(part.pin_memory() if pin else part for part in parts))


@torch.inference_mode()
def score_batch(scorer: Scorer, batch: Batch) -> Scores:
    """One batch through CLIP and the heads; the device's results copied back at once."""
    device = scorer.device
    out = scorer.model(
        input_ids=batch.token_ids.to(device, non_blocking=True),
        attention_mask=batch.attention_mask.to(device, non_blocking=True),
        pixel_values=batch.pixels.to(device, scorer.dtype, non_blocking=True),
    )
    # CLIPModel's embeddings are L2-normalised already, as the heads take them.
    images, texts = out.image_embeds.float(), out.text_embeds.float()
    # torchmetrics' CLIPScore: 100 x the cosine, 0 at worst.
    clip_score = (100 * (images * texts).sum(dim=-1)).clamp(min=0)
    aesthetic = scorer.aesthetic(images).squeeze(-1) if scorer.aesthetic is not None else None
    nsfw = scorer.nsfw(images).squeeze(-1) if scorer.nsfw is not None else None
    return Scores(
        embeddings=images.half().cpu().numpy(),
        clip_score=clip_score.cpu().numpy(),
        aesthetic=aesthetic.cpu().numpy() if aesthetic is not None else None,
        nsfw=nsfw.cpu().numpy() if nsfw is not None else None,
    )


def joined(parts: list[Scores], width: int) -> Scores:
    """A shard's batches' scores as one (a shard with no kept sample has none)."""
    if not parts:
        return Scores(np.empty((0, width), np.float16), np.empty(0, np.float32), None, None)

    def cat(name: str) -> np.ndarray | None:
        values = [getattr(part, name) for part in parts]
        return None if values[0] is None else np.concatenate(values)

    return Scores(*(cat(name) for name in ("embeddings", "clip_score", "aesthetic", "nsfw")))
