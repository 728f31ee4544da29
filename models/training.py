"""Training as the producer and the train workers both see it: a run's options, the spec
of one train-shard job, and where checkpoints live."""

from dataclasses import asdict, dataclass, field
from typing import Any

from sdq.models.specs import canonical_sha256

MIXED_PRECISION = ("no", "fp16", "bf16")
SPEC_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """What decides a training run's weights, fixed when it is submitted."""

    steps: int
    batch_size: int = 8
    lr: float = 1e-4
    lr_warmup: int = 0
    checkpoint_every: int = 100
    ema: float | None = 0.9999  # None: no EMA weights
    min_snr: float | None = 5.0  # None: plain MSE
    seed: int = 0
    mixed_precision: str = "no"
    gradient_checkpointing: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed precision must be one of {', '.join(MIXED_PRECISION)}")
        if min(self.steps, self.batch_size, self.checkpoint_every) < 1 or self.lr_warmup < 0:
            raise ValueError("steps, batch size and checkpoint interval must be positive")
        if self.ema is not None and not 0 < self.ema < 1:
            raise ValueError("--ema must be between 0 and 1")


@dataclass(frozen=True, kw_only=True)
class LatentInput:
    """One latent shard a run reads, and how many samples it holds."""

    uri: str
    key: str
    samples: int


@dataclass(frozen=True, kw_only=True)
class Validation:
    """Images rendered from every checkpoint with fixed prompts and seeds, so that a run's
    page shows how they change as it trains."""

    prompts: tuple[tuple[str, int], ...]  # (prompt, seed)
    size: int
    scheduler: str
    dtype: str
    steps: int = 25
    guidance: float = 7.5


@dataclass(frozen=True, kw_only=True)
class TrainShardSpec:
    """One train-shard job: steps (first_step, last_step] of run `run`, from the
    checkpoint at first_step (none when 0) to the one at last_step."""

    run: int
    first_step: int
    last_step: int
    # What its checkpoints are registered as: `--into NAME`, else the run id.
    model_name: str
    base_name: str
    base_source: str
    base_revision: str
    prediction_type: str
    scheduler_config: dict[str, Any]
    options: TrainOptions
    inputs: tuple[LatentInput, ...] = field(default=())
    validation: Validation | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainShardSpec":
        validation = data.get("validation")
        if validation is not None:
            prompts = tuple((prompt, seed) for prompt, seed in validation["prompts"])
            validation = Validation(**{**validation, "prompts": prompts})
        nested = ("options", "inputs", "validation")
        return cls(
            **{key: value for key, value in data.items() if key not in nested},
            options=TrainOptions(**data["options"]),
            inputs=tuple(LatentInput(**item) for item in data["inputs"]),
            validation=validation,
        )

    def hash(self) -> str:
        # The run is part of it: two runs never share checkpoints, whatever their options.
        return canonical_sha256({**self.to_dict(), "version": SPEC_VERSION})


def checkpoint_prefix(run: int, step: int) -> str:
    return f"train/{run}/checkpoints/{step:08d}"
