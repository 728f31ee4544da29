"""CLIP scoring on the device: each image's CLIP embedding, its CLIP score against its
caption, and the heads' scores of the embedding, batch by batch, the images decoded and the
captions tokenized on threads ahead of the device. GPU-side: imports torch."""

import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from math import ceil

import numpy as np
import torch
from PIL import Image
from transformers import CLIPImageProcessorPil, CLIPModel, CLIPTokenizer

from sdq.models import tiny
from sdq.models.curate.clip import ScorerRef
from sdq.models.store import ObjectStore
from sdq.workers.curate.heads import aesthetic_head, nsfw_head, read_head
from sdq.workers.gpu import device_name, release_device_memory
from sdq.workers.shards.images import ImageShard
from sdq.workers.shards.pixels import to_rgb
from sdq.workers.tiny import build_clip
from sdq.workers.weights import ModelFiles, ModelUnavailable, check_tiny_revision

CLIP_CONFIG = "config.json"


@dataclass(frozen=True)
class Pixels:
    """CLIP's image processor, split where the work is cheapest: the resize and center
    crop on the host, to bytes (a quarter of float32's to copy to a GPU), and the rescale
    and normalisation on the device, as a table of what the processor makes of each byte
    value in each channel (its own float64 arithmetic, so the values are its own). The
    processor spends ~1.3 ms an image on a CPU, under a third of it in the resize itself; the
    rest (checks, conversions, float arithmetic on each image) is not spent here."""

    size: dict[str, int]  # the processor's: {"shortest_edge": S} or {"height", "width"}
    crop: tuple[int, int] | None  # height, width
    resample: Image.Resampling
    table: torch.Tensor  # float32 [3, 256], on the device

    @classmethod
    def of(cls, processor: CLIPImageProcessorPil, device: torch.device) -> "Pixels":
        size = {key: value for key, value in dict(processor.size).items() if value}
        if processor.do_resize and set(size) not in ({"shortest_edge"}, {"height", "width"}):
            raise ModelUnavailable(f"the image processor's size {size}: sdq resizes by "
                                   "shortest_edge or to height and width")  # fmt: skip
        values = np.arange(256, dtype=np.float64)
        if processor.do_rescale:
            values = values * processor.rescale_factor  # in float64, as the processor does
        values = np.tile(values.astype(np.float32), (3, 1))  # and in float32 from here
        if processor.do_normalize:
            mean = np.asarray(processor.image_mean, dtype=np.float32)[:, None]
            std = np.asarray(processor.image_std, dtype=np.float32)[:, None]
            values = (values - mean) / std
        crop = dict(processor.crop_size) if processor.do_center_crop else None
        return cls(
            size=size if processor.do_resize else {},
            crop=(crop["height"], crop["width"]) if crop else None,
            resample=Image.Resampling(processor.resample),
            table=torch.from_numpy(values).to(device),
        )

    def cropped(self, image: Image.Image) -> np.ndarray:
        """The image resized and center-cropped, as uint8 [3, H, W]."""
        if self.size:
            image = image.resize(self._resized(*image.size), resample=self.resample)
        pixels = np.asarray(image).transpose(2, 0, 1)
        return pixels if self.crop is None else _center_crop(pixels, *self.crop)

    def _resized(self, width: int, height: int) -> tuple[int, int]:
        """The size the processor resizes to: the short side to shortest_edge, the long
        side in proportion, rounded down."""
        if "shortest_edge" not in self.size:
            return self.size["width"], self.size["height"]
        short, long = sorted((width, height))
        new_short = self.size["shortest_edge"]
        new_long = int(new_short * long / short)
        return (new_short, new_long) if width <= height else (new_long, new_short)

    def normalized(self, pixels: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Bytes [B, 3, H, W] on the device as the processor's values."""
        channel = torch.arange(3, device=pixels.device).view(1, 3, 1, 1) * 256
        return self.table.view(-1)[pixels.long() + channel].to(dtype)


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """The processor's center crop of [C, H, W]: zero bytes around an image smaller than
    the crop."""
    _, rows, columns = pixels.shape
    if rows < height or columns < width:
        padded = np.zeros((3, max(rows, height), max(columns, width)), np.uint8)
        top, left = ceil((padded.shape[1] - rows) / 2), ceil((padded.shape[2] - columns) / 2)
        padded[:, top : top + rows, left : left + columns] = pixels
        top, left = top + (rows - height) // 2, left + (columns - width) // 2
        return padded[:, top : top + height, left : left + width]
    top, left = (rows - height) // 2, (columns - width) // 2
    return pixels[:, top : top + height, left : left + width]


@dataclass(frozen=True)
class Scorer:
    model: CLIPModel
    pixels: Pixels
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
        self._key: ScorerRef | None = None
        self._scorer: Scorer | None = None

    def clear(self) -> None:
        self._key, self._scorer = None, None
        release_device_memory()

    def get(self, ref: ScorerRef) -> Scorer:
        if ref != self._key or self._scorer is None:
            self._scorer = None  # the old weights go before the new ones load
            self._scorer = self._load(ref)
            self._key = ref
        return self._scorer

    def _load(self, ref: ScorerRef) -> Scorer:
        device = torch.device(device_name())
        # Half precision on a GPU; scores are read as float32 either way.
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        model, tokenizer, processor = self._clip(ref, dtype)
        return Scorer(
            model=model.to(device, dtype).eval().requires_grad_(False),
            pixels=Pixels.of(processor, device),
            tokenizer=tokenizer,
            aesthetic=self._head(ref.aesthetic_head, aesthetic_head, device),
            nsfw=self._head(ref.nsfw_head, nsfw_head, device),
            device=device,
            dtype=dtype,
        )

    def _clip(
        self, ref: ScorerRef, dtype: torch.dtype
    ) -> tuple[CLIPModel, CLIPTokenizer, CLIPImageProcessorPil]:
        if ref.model_source == tiny.TINY_NAME:
            check_tiny_revision(ref.model_revision, tiny.clip_revision())
            return build_clip()
        where = self.files.locate(ref.model_source, ref.model_revision, marker=CLIP_CONFIG)
        return (
            # Loaded in the dtype it runs in: no float32 copy of a large CLIP on the way.
            CLIPModel.from_pretrained(where.path, revision=where.revision, dtype=dtype),
            CLIPTokenizer.from_pretrained(where.path, revision=where.revision),
            CLIPImageProcessorPil.from_pretrained(where.path, revision=where.revision),
        )

    def _head(self, key: str | None, build, device: torch.device) -> torch.nn.Module | None:
        if key is None:
            return None
        head = build(read_head(self.store.get_bytes(key), key), key)
        return head.to(device, torch.float32).eval().requires_grad_(False)


@dataclass(frozen=True)
class Batch:
    pixels: torch.Tensor  # uint8: resized and cropped as CLIP's processor does
    token_ids: torch.Tensor
    attention_mask: torch.Tensor


@dataclass(frozen=True)
class Scores:
    embeddings: np.ndarray  # float32, L2-normalised, one row per image
    clip_score: np.ndarray
    aesthetic: np.ndarray | None
    nsfw: np.ndarray | None


def prepare_batches(
    shard: ImageShard, scorer: Scorer, *, batch_size: int, decoders: ThreadPoolExecutor
) -> Iterator[Batch]:
    """The CPU work, batch by batch: decoding, resizing and cropping on `decoders` (Pillow
    decodes and resizes without the GIL), the captions tokenized to CLIP's length."""
    pin = scorer.device.type == "cuda"
    length = scorer.model.config.text_config.max_position_embeddings

    def pixels(data: bytes) -> np.ndarray:
        with Image.open(io.BytesIO(data)) as image:
            return scorer.pixels.cropped(to_rgb(image))

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
        pixel_values=scorer.pixels.normalized(
            batch.pixels.to(device, non_blocking=True), scorer.dtype
        ),
    )
    # CLIPModel's embeddings are L2-normalised already, as the heads take them.
    images, texts = out.image_embeds.float(), out.text_embeds.float()
    # torchmetrics' CLIPScore: 100 x the cosine, 0 at worst.
    clip_score = (100 * (images * texts).sum(dim=-1)).clamp(min=0)
    aesthetic = scorer.aesthetic(images).squeeze(-1) if scorer.aesthetic is not None else None
    nsfw = scorer.nsfw(images).squeeze(-1) if scorer.nsfw is not None else None
    return Scores(
        embeddings=images.cpu().numpy(),
        clip_score=clip_score.cpu().numpy(),
        aesthetic=aesthetic.cpu().numpy() if aesthetic is not None else None,
        nsfw=nsfw.cpu().numpy() if nsfw is not None else None,
    )


def joined(parts: list[Scores], width: int) -> Scores:
    """A shard's batches' scores as one (a shard with no kept sample has none)."""
    if not parts:
        return Scores(np.empty((0, width), np.float32), np.empty(0, np.float32), None, None)

    def cat(name: str) -> np.ndarray | None:
        values = [getattr(part, name) for part in parts]
        return None if values[0] is None else np.concatenate(values)

    return Scores(*(cat(name) for name in ("embeddings", "clip_score", "aesthetic", "nsfw")))
