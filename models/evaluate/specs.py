"""Evaluation as the producer, the train workers and the evaluate workers see it: what a
run asks of its checkpoints, and the spec of one evaluate job (one model scored). No torch.

Metrics, as the field computes them:
- heldout_loss: the denoising loss (plain MSE against the model's target) of held-out
  samples, each at the same fixed timesteps spread over the schedule, its noise drawn from
  its key: every checkpoint is scored on exactly the same draws.
- clip_score: torchmetrics' CLIP score (100 x the cosine of a render's CLIP image embedding
  and its prompt's text embedding, 0 at worst), averaged over fixed prompts and seeds.
- fd_clip: the Fréchet distance between the renders' and real held-out images' CLIP image
  embeddings (Gaussians fitted to each, as FID does with Inception features).
- kid: the kernel distance (unbiased MMD², cubic polynomial kernel, as KID) of the same
  embeddings: unbiased, so it can be trusted at the few hundred images where FD cannot.
- fid: the Fréchet distance of the same renders and real images on Inception-v3's 2048
  pool features (the FID graph, with the weights file torchmetrics and torch-fidelity use,
  `--fid-weights`): the figure papers quote, comparable with theirs at 50,000 images only.
"""

from dataclasses import asdict, dataclass, replace
from typing import Any

from sdq.models.curate.clip import ClipIdentity
from sdq.models.generate.specs import FixedRenders
from sdq.models.specs import canonical_sha256

METRICS = ("heldout_loss", "clip_score", "fd_clip", "kid", "fid")
# The rest are best lowest (a loss, distances).
HIGHER_IS_BETTER = frozenset({"clip_score"})
# What needs images rendered by the model, a CLIP model, real held-out images, Inception.
RENDERED = frozenset({"clip_score", "fd_clip", "kid", "fid"})
CLIP_SCORED = frozenset({"clip_score", "fd_clip", "kid"})
AGAINST_REAL = frozenset({"fd_clip", "kid", "fid"})
SPEC_VERSION = 1


def best_of(metric: str, values: dict[int, float | None]) -> int | None:
    """The step whose value of `metric` is best: lowest for losses and distances, highest
    for clip_score (the earliest of equals). Values that are no number (None, a diverged
    model's) are never best; None where no value is a number."""
    sign = -1 if metric in HIGHER_IS_BETTER else 1
    numbers = {step: value for step, value in values.items() if value is not None}
    return min(sorted(numbers), key=lambda step: sign * numbers[step], default=None)


@dataclass(frozen=True, kw_only=True)
class HeldOut:
    """A run's held-out samples (models/train/holdout.py): the first `samples` of them in
    the order of the run's latent shards, listed at submit in the store under `key`
    (held_out_manifest), each scored at `timesteps` timesteps."""

    key: str
    fraction: float
    seed: int
    samples: int
    timesteps: int = 8


@dataclass(frozen=True)
class FidWeights:
    """The Inception-v3 weights fid is computed with: a file (pt_inception-2015-12-05, as
    torchmetrics and torch-fidelity load it) where the workers can read it, named by its
    content."""

    source: str  # an absolute path, or s3://bucket/key
    sha256: str


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """What a train run asks of its checkpoints (`--eval-metrics`): every `every`-th of its
    checkpoints, and its last, is scored by an evaluate job of its own
    (TrainShardSpec.evaluates)."""

    metrics: tuple[str, ...]
    every: int = 1
    held_out: HeldOut | None = None
    rendering: FixedRenders | None = None
    clip: ClipIdentity | None = None  # what scores renders
    fid_weights: FidWeights | None = None
    # The trackers the scores go to besides SQL (the run's `--report-to`).
    report_to: tuple[str, ...] = ()

    def too_few_to_compare(self, *, more_renders: str, more_real: str) -> str | None:
        """Why its distances from real images cannot be taken, with the advice for the side
        that is short; None where they can, or none is asked. FID's and fd_clip's
        covariances, and KID's unbiased mean over pairs, need two features a side at least:
        with one, they are not numbers."""
        compared = sorted(AGAINST_REAL & set(self.metrics))
        real = self.held_out.samples if self.held_out else 0
        renders = len(self.rendering.prompts) if self.rendering else 0
        if not compared or min(real, renders) >= 2:
            return None
        advice = [more for more, few in ((more_renders, renders < 2), (more_real, real < 2)) if few]
        return (f"{', '.join(compared)} need at least 2 renders and 2 real images to compare, "
                f"and this evaluation has {renders} and {real}: {'; '.join(advice)}")  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Evaluation":
        rendering, held_out, clip = data.get("rendering"), data.get("held_out"), data.get("clip")
        fid_weights = data.get("fid_weights")
        return cls(**{
            **data,
            "metrics": tuple(data["metrics"]),
            "report_to": tuple(data.get("report_to", ())),
            "held_out": HeldOut(**held_out) if held_out else None,
            "rendering": FixedRenders.from_dict(rendering) if rendering else None,
            "clip": ClipIdentity(**clip) if clip else None,
            "fid_weights": FidWeights(**fid_weights) if fid_weights else None,
        })  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class EvaluateSpec:
    """One model scored by `evaluation`'s metrics: a training checkpoint's (`run` and
    `step` say where its scores belong) or any model's. The renders are generation jobs
    of their own, named here by their spec hashes in the prompts' order."""

    model_name: str
    model_source: str
    model_revision: str
    evaluation: Evaluation
    renders: tuple[str, ...] = ()
    run: int | None = None
    step: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EvaluateSpec":
        return cls(
            **{key: value for key, value in data.items() if key not in ("evaluation", "renders")},
            evaluation=Evaluation.from_dict(data["evaluation"]),
            renders=tuple(data["renders"]),
        )

    def hash(self) -> str:
        """What decides the scores: the model's weights (its revision), the metrics, the
        held-out samples, the renders and the scorer; not the names it goes by, nor how
        often a run asks, nor where the scores are reported (the same checkpoint and spec
        are scored once)."""
        identity = asdict(replace(self.evaluation, every=1, report_to=()))
        if identity["fid_weights"] is None:
            del identity["fid_weights"]  # as specs were hashed before fid: scored once still
        return canonical_sha256(
            {
                "model_revision": self.model_revision,
                "evaluation": identity,
                "renders": list(self.renders),
                "version": SPEC_VERSION,
            }
        )

    @property
    def output_key(self) -> str:
        return scores_key(self.hash())


def held_out_key(run: int) -> str:
    """A run's held-out samples as evaluation reads them: one parquet row each, its latent
    shard and row, its key and caption, and its image shard (HELD_OUT_COLUMNS)."""
    return f"train/{run}/held_out.parquet"


HELD_OUT_COLUMNS = ("latent_key", "row", "key", "caption", "image_key", "image_format")


def scores_key(spec_hash: str) -> str:
    """An evaluate job's scores in the store, as JSON, named by its spec's hash."""
    return f"evaluate/{spec_hash}.json"


def reference_key(held_out: HeldOut, extractor: str, revision: str) -> str:
    """The real held-out images' features (`extractor` "clip": CLIP image embeddings,
    "inception": FID's pool features), computed once per (held-out samples, feature
    extractor) and kept in the store for every model compared with them."""
    digest = canonical_sha256({**asdict(held_out), extractor: revision, "timesteps": None})
    return f"evaluate/reference/{digest}.npy"
