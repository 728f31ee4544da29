"""The metrics on the device, each as the field computes it (models/evaluate/specs.py says
what each is). GPU-side: imports torch and diffusers.

The CLIP side is curate's scorer (workers/curate/scoring.py): the same image processing,
the same CLIP score; the distances are computed in float64 on the CPU from float32
embeddings, as torchmetrics computes FID and KID from its features.
"""

import hashlib
import io
import itertools
import pickle
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DConditionModel
from PIL import Image

from sdq.models import tiny
from sdq.models.curate.clip import ClipIdentity, ScorerRef
from sdq.models.evaluate.specs import FidWeights
from sdq.models.specs import AUTO_DTYPE
from sdq.models.store import ObjectStore
from sdq.workers.curate.scoring import Batch, LoadedScorers, Scorer, score_batch
from sdq.workers.evaluate.held_out import HeldOutSamples
from sdq.workers.evaluate.inception import (
    SIZE,
    FidInceptionV3,
    load_fid_inception,
    resize_like_tensorflow,
)
from sdq.workers.gpu import device_name, release_device_memory, torch_dtype
from sdq.workers.shards.pixels import to_rgb
from sdq.workers.tiny import build_pipeline
from sdq.workers.weights import ModelFiles, ModelUnavailable, check_tiny_revision

# Images through CLIP at once; samples x timesteps through the U-Net at once; threads that
# decode images.
CLIP_BATCH = 32
UNET_BATCH = 16
DECODERS = 4
# What torch.load and a strict load_state_dict raise on a file that holds other weights.
UNREADABLE_WEIGHTS = (RuntimeError, TypeError, AttributeError, EOFError, pickle.UnpicklingError)


def fixed_timesteps(scheduler: DDPMScheduler, count: int) -> torch.Tensor:
    """`count` timesteps spread evenly over the schedule, its ends included."""
    last = scheduler.config.num_train_timesteps - 1
    return torch.linspace(0, last, count).round().long()


def sample_noise(key: str, timestep: int, shape: Sequence[int]) -> torch.Tensor:
    """The noise of held-out sample `key` at `timestep`, from its own CPU generator: the
    same draws for every checkpoint, on any device."""
    digest = hashlib.blake2b(f"{key}/{timestep}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    return torch.randn(tuple(shape), generator=generator)


@torch.inference_mode()
def heldout_loss(
    unet: UNet2DConditionModel,
    scheduler: DDPMScheduler,
    samples: HeldOutSamples,
    timesteps: int,
) -> float:
    """The mean denoising MSE of every sample at each of the fixed timesteps, against the
    target the model is trained for (the noise, or the velocity)."""
    device, dtype = unet.device, unet.dtype
    pairs = [(index, int(t)) for index in range(len(samples.keys))
             for t in fixed_timesteps(scheduler, timesteps)]  # fmt: skip
    total = 0.0
    for part in _of_one_shape(pairs, samples):
        stacked = _stacked(samples, [index for index, _ in part])
        latents = stacked.pop("latents").float()
        embeddings = stacked.pop("text_embeddings").to(device, dtype)
        added = {name: tensor.to(device, dtype) for name, tensor in stacked.items()}
        noise = torch.stack([sample_noise(samples.keys[i], t, latents.shape[1:]) for i, t in part])
        steps = torch.tensor([t for _, t in part])
        noisy = scheduler.add_noise(latents, noise, steps)
        if scheduler.config.prediction_type == "v_prediction":
            target = scheduler.get_velocity(latents, noise, steps)
        else:
            target = noise
        prediction = unet(
            noisy.to(device, dtype), steps.to(device), embeddings, added_cond_kwargs=added or None
        ).sample
        errors = F.mse_loss(prediction.float().cpu(), target, reduction="none")
        total += float(errors.mean(dim=[1, 2, 3]).sum())
    return total / len(pairs)


def _of_one_shape(
    pairs: list[tuple[int, int]], samples: HeldOutSamples
) -> Iterator[list[tuple[int, int]]]:
    """(sample, timestep) pairs in batches of at most UNET_BATCH whose samples have one
    shape (a run on buckets holds out several); one shape's in their order."""

    def shape(pair: tuple[int, int]) -> tuple[int, ...]:
        return samples.tensors[pair[0]]["latents"].shape

    for _, group in itertools.groupby(sorted(pairs, key=shape), key=shape):
        alike = list(group)
        for start in range(0, len(alike), UNET_BATCH):
            yield alike[start : start + UNET_BATCH]


def _stacked(samples: HeldOutSamples, rows: list[int]) -> dict[str, torch.Tensor]:
    """The rows' tensors, each stacked into a batch."""
    return {
        name: torch.from_numpy(np.stack([samples.tensors[row][name] for row in rows]))
        for name in samples.tensors[rows[0]]
    }


def _decoded(
    images: Sequence[bytes], prepare: Callable[[Image.Image], torch.Tensor]
) -> Iterator[torch.Tensor]:
    """The images decoded to RGB and prepared, a batch at a time, on threads (Pillow decodes
    and resizes without the GIL)."""

    def decoded(data: bytes) -> torch.Tensor:
        with Image.open(io.BytesIO(data)) as image:
            return prepare(to_rgb(image))

    with ThreadPoolExecutor(DECODERS) as decoders:
        for start in range(0, len(images), CLIP_BATCH):
            yield torch.stack(list(decoders.map(decoded, images[start : start + CLIP_BATCH])))


def _pixels(scorer: Scorer, images: Sequence[bytes]) -> Iterator[torch.Tensor]:
    """The images resized and cropped as CLIP's processor does."""
    return _decoded(images, lambda image: torch.tensor(scorer.pixels.cropped(image)))


@torch.inference_mode()
def _image_embeddings(scorer: Scorer, pixels: torch.Tensor) -> np.ndarray:
    """CLIPModel's image_embeds (its image tower and projection, L2-normalised), as float32,
    without its text tower."""
    values = scorer.pixels.normalized(pixels.to(scorer.device), scorer.dtype)
    pooled = scorer.model.vision_model(pixel_values=values).pooler_output
    embeddings = scorer.model.visual_projection(pooled).float()
    return (embeddings / embeddings.norm(dim=-1, keepdim=True)).cpu().numpy()


def image_embeddings(scorer: Scorer, images: Sequence[bytes]) -> np.ndarray:
    """Each image's L2-normalised CLIP image embedding, as float32."""
    return np.concatenate([_image_embeddings(scorer, batch) for batch in _pixels(scorer, images)])


def clip_scores(
    scorer: Scorer, images: Sequence[bytes], texts: Sequence[str]
) -> tuple[np.ndarray, np.ndarray]:
    """Each image's embedding (as image_embeddings), and its CLIP score against its text
    (curate's score_batch)."""
    length = scorer.model.config.text_config.max_position_embeddings
    scores = []
    starts = range(0, len(images), CLIP_BATCH)
    for start, pixels in zip(starts, _pixels(scorer, images), strict=True):
        tokens = scorer.tokenizer(
            list(texts[start : start + CLIP_BATCH]), padding="max_length", max_length=length,
            truncation=True, return_tensors="pt",
        )  # fmt: skip
        scores.append(score_batch(scorer, Batch(pixels, tokens.input_ids, tokens.attention_mask)))
    return (
        np.concatenate([score.embeddings for score in scores]),
        np.concatenate([score.clip_score for score in scores]),
    )


def _fid_inputs(images: Sequence[bytes]) -> Iterator[torch.Tensor]:
    """The images resized to Inception's 299 px one at a time (they need not share a size),
    on the CPU in float32, where the FID graph's resize is exact."""

    def resized(image: Image.Image) -> torch.Tensor:
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)
        return resize_like_tensorflow(pixels[None].float(), SIZE)[0]

    return _decoded(images, resized)


@torch.inference_mode()
def inception_features(model: FidInceptionV3, images: Sequence[bytes]) -> np.ndarray:
    """Each image's 2048 pool features on the FID graph, as float32."""
    device = model.fc.weight.device
    return np.concatenate([
        model.pool_features(batch.to(device)).cpu().numpy() for batch in _fid_inputs(images)
    ])  # fmt: skip


def frechet_distance(first: np.ndarray, second: np.ndarray) -> float:
    """The Fréchet distance between Gaussians fitted to two sets of features (rows), as
    torchmetrics computes FID: |mu1 - mu2|² + tr(S1) + tr(S2) - 2 tr(sqrt(S1 S2)), the
    covariances unbiased, the square root's trace from the eigenvalues of S1 S2."""
    a, b = (torch.from_numpy(np.asarray(x, np.float64)) for x in (first, second))
    mean_a, mean_b = a.mean(dim=0), b.mean(dim=0)
    cov_a, cov_b = torch.cov(a.T), torch.cov(b.T)
    roots = torch.linalg.eigvals(cov_a @ cov_b).sqrt().real.sum()
    return float((mean_a - mean_b).square().sum() + cov_a.trace() + cov_b.trace() - 2 * roots)


def kernel_distance(first: np.ndarray, second: np.ndarray) -> float:
    """KID: the unbiased MMD² of two sets of features under the cubic polynomial kernel
    (x·y / d + 1)³, as torchmetrics computes it on one subset holding every feature."""
    a, b = (torch.from_numpy(np.asarray(x, np.float64)) for x in (first, second))
    width = a.shape[1]

    def kernel(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x @ y.T / width + 1) ** 3

    m, n = len(a), len(b)
    k_aa, k_bb, k_ab = kernel(a, a), kernel(b, b), kernel(a, b)
    within_a = (k_aa.sum() - k_aa.diagonal().sum()) / (m * (m - 1))
    within_b = (k_bb.sum() - k_bb.diagonal().sum()) / (n * (n - 1))
    return float(within_a + within_b - 2 * k_ab.mean())


class LoadedModels:
    """What this process scores with, kept from job to job: the U-Net and noise schedule
    of the last model whose held-out loss it took, and the last CLIP model (curate's
    scorer). A run's evaluations come one checkpoint after another, each a new U-Net."""

    def __init__(self, files: ModelFiles, store: ObjectStore) -> None:
        self.files = files
        self.scorers = LoadedScorers(files, store)
        self._unet_of: tuple[str, str] | None = None
        self._unet: tuple[UNet2DConditionModel, DDPMScheduler] | None = None
        self._inception: tuple[str, FidInceptionV3] | None = None

    def clear(self) -> None:
        self.scorers.clear()
        self._unet_of, self._unet, self._inception = None, None, None
        release_device_memory()

    def inception(self, weights: FidWeights) -> FidInceptionV3:
        """The FID graph with these weights, in float32 as torch-fidelity runs it."""
        if self._inception is None or self._inception[0] != weights.sha256:
            path = self.files.content_file(weights.source, weights.sha256,
                                           what="Inception weights", suffix=".pth")  # fmt: skip
            try:
                model = load_fid_inception(torch.load(path, map_location="cpu", weights_only=True))
            except UNREADABLE_WEIGHTS as error:
                raise ModelUnavailable(
                    f"--fid-weights {weights.source} are not Inception-v3's FID weights "
                    f"(pt_inception-2015-12-05): {_first_words(error)}"
                ) from None
            self._inception = (weights.sha256, model.to(device_name()))
        return self._inception[1]

    def scorer(self, clip: ClipIdentity) -> Scorer:
        return self.scorers.get(ScorerRef(clip.source, clip.revision))

    def unet(self, source: str, revision: str) -> tuple[UNet2DConditionModel, DDPMScheduler]:
        if (source, revision) != self._unet_of or self._unet is None:
            self._unet = None  # the old weights go before the new ones load
            self._unet = self._load_unet(source, revision)
            self._unet_of = (source, revision)
        return self._unet

    def _load_unet(self, source: str, revision: str) -> tuple[UNet2DConditionModel, DDPMScheduler]:
        dtype = torch_dtype(AUTO_DTYPE)
        if source == tiny.TINY_NAME:
            check_tiny_revision(revision)
            pipeline = build_pipeline()
            unet, config = pipeline.unet, pipeline.scheduler.config
        else:
            where = self.files.locate(source, revision)
            unet = UNet2DConditionModel.from_pretrained(
                where.path, subfolder="unet", revision=where.revision
            )
            config = DDPMScheduler.load_config(
                where.path, subfolder="scheduler", revision=where.revision
            )
        unet = unet.to(device_name(), dtype).eval().requires_grad_(False)
        return unet, DDPMScheduler.from_config(config)


def _first_words(error: Exception, most: int = 300) -> str:
    """An error's first lines, on one line and cut at `most` characters: torch's refusal of
    a state dict says what it is in its first line and which keys in its second (hundreds of
    them, for a whole other model's)."""
    said = " ".join(line.strip() for line in str(error).splitlines()[:2] if line.strip())
    return said if len(said) <= most else f"{said[: most - 3]}..."
