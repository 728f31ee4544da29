"""Training as the producer and the train workers both see it: a run's options, the spec
of one train-shard job, and where checkpoints live."""

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from sdq.models.evaluate.specs import Evaluation
from sdq.models.generate.specs import FixedRenders
from sdq.models.specs import canonical_sha256, option, refuse_undeclared

# "auto": bf16 on a GPU, none on a CPU (which has no fast half-precision kernels).
MIXED_PRECISION = ("auto", "no", "fp16", "bf16")
# With no --data-lanes, a batch is dealt over up to this many lanes (or the world size, when
# larger): runs of 1, 2, 4 and 8 ranks then read the same samples in the same order.
DEFAULT_MAX_LANES = 8
# After warmup: hold the rate, or take it down to 0 by the last step (diffusers' schedules).
LR_SCHEDULES = ("constant", "cosine", "linear")
# How a run's training state is spread over its ranks (FSDP2's fully_shard): "none" keeps
# all of it on every rank (DDP); "grad-op" shards gradients, optimizer state and EMA
# weights, and keeps the weights a forward pass gathered until its backward is done (ZeRO-2,
# the seed's SHARD_GRAD_OP); "full" shards the weights too, gathered block by block in the
# forward and again in the backward (ZeRO-3).
SHARDINGS = ("none", "grad-op", "full")
# The precision gradients cross between ranks in: bf16 halves the bytes sent between nodes.
GRAD_COMMS = ("fp32", "bf16")
SPEC_VERSION = 1
# Where `--report-to` sends a run's figures besides SQL (workers/tracking.py).
TRACKERS = ("tensorboard", "wandb")
# The U-Net layers a LoRA run adapts (workers/train/loop/lora.py names their modules).
LORA_TARGETS = ("attention", "attention+ff")
# What a LoRA run's model is: one file, as diffusers' save_lora_weights names it, under the
# checkpoint's model prefix.
LORA_FILE = "pytorch_lora_weights.safetensors"


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """What decides a training run's weights, fixed when it is submitted. Each is declared
    once, here: `sdq train`'s options are built from these declarations
    (producer/cli/options.py)."""

    steps: int = option(help="Optimizer steps.", low=1)
    # Samples per optimizer step, over all ranks and accumulated micro-batches together.
    batch_size: int = option(
        8, low=1, help="Samples per optimizer step, over all ranks and micro-batches (the "
        "global batch).",
    )  # fmt: skip
    lr: float = option(1e-4, low=0, help="AdamW learning rate, after warmup.")
    lr_warmup: int = option(0, low=0, help="Steps of linear warmup from 0 to --lr.")
    checkpoint_every: int = option(
        100, low=1, help="Steps per train-shard job: each ends with a checkpoint."
    )
    # A job also ends, with its checkpoint, after this many minutes of steps: a job's length
    # set in time (None: by --checkpoint-every and the train queue's time limit alone).
    checkpoint_minutes: float | None = option(
        None, low=0, above=True, shown="--checkpoint-every alone",
        help="Also end a job, with its checkpoint, after this many minutes of steps (its next "
        "job goes on from there): a job's length in time. It must fit the train queue's time "
        "limit.",
    )  # fmt: skip
    lr_schedule: str = option(
        "constant", choices=LR_SCHEDULES,
        help="After warmup: hold --lr, or bring it down to 0 by the last step.",
    )  # fmt: skip
    # Data-parallel ranks (processes, one per GPU) each train-shard job runs on, spread
    # evenly over this many machines (nodes).
    world_size: int = option(
        1, low=1,
        help="Data-parallel ranks, one GPU each (CPU processes without GPUs), that every "
        "train-shard job runs on; each trains on its share of every batch. A worker started "
        "with `sdq worker gpu --train-ranks N` takes runs of world size up to N.",
    )  # fmt: skip
    sharding: str = option(
        "none", choices=SHARDINGS,
        help="Spread the training state over the ranks (FSDP2): grad-op shards gradients, "
        "optimizer and EMA (ZeRO-2); full shards the weights too (ZeRO-3), for a model whose "
        "state does not fit one GPU. Checkpoints are then written by every rank, its own part.",
    )  # fmt: skip
    grad_comm: str = option(
        "fp32", choices=GRAD_COMMS,
        help="The precision gradients are averaged across ranks in: bf16 halves what crosses "
        "between nodes, at bf16's rounding of each rank's gradient.",
    )  # fmt: skip
    nodes: int = option(
        1, low=1,
        help="Machines the --world-size ranks are spread over, evenly: each job's gang of "
        "train workers gathers through the database (docs/training.md, 'Several machines').",
    )  # fmt: skip
    # The run's samples come in this many lanes of shards, each read by one rank (see
    # workers/train/loop/data.py): the world size divides it, and it divides the batch
    # size. Fixed at submit (None: the default, see default_lanes), so that the run trains
    # on the same samples whatever world size later resumes it.
    data_lanes: int | None = option(
        None, low=1, shown="the most, up to 8 or the world size, that divide the batch",
        help="Lanes the run's latent shards are dealt to; each rank reads whole lanes, so the "
        "world size must divide them, and they the batch size. Runs with the same lanes train "
        "on the same samples at any world size.",
    )  # fmt: skip
    # Micro-batches whose gradients add up to one optimizer step, on each rank.
    grad_accumulation: int = option(
        1, low=1,
        help="Micro-batches per optimizer step on each rank: a batch larger than fits at once.",
    )  # fmt: skip
    max_grad_norm: float | None = option(
        None, low=0, above=True, zero_is_none=True,
        help="Clip the gradients' global norm to this; 0 clips nothing.",
    )  # fmt: skip
    # The share of samples trained on the empty prompt's embedding instead of their
    # caption's: what classifier-free guidance needs the model to know.
    # Samples chosen at submit, by sample and seeded, that the run never trains on
    # (models/train/holdout.py): what evaluation's held-out loss and real images come from.
    holdout: float = option(
        0.0, low=0, high=1, below=True,
        help="Share of the samples held out of training, chosen by sample from --seed: the "
        "held-out loss and the real images of the Fréchet distances come from them.",
    )  # fmt: skip
    caption_dropout: float = option(
        0.0, low=0, high=1, below=True,
        help="Share of samples trained on the empty prompt instead of their caption, so that "
        "the model serves classifier-free guidance (0.1 is usual for pre-training).",
    )  # fmt: skip
    # Offset noise (Guttenberg 2023): a per-channel constant added to the noise, so the
    # model learns to change an image's mean brightness.
    noise_offset: float = option(
        0.0, low=0,
        help="Offset noise strength (0.05-0.1 lets the model learn very dark or bright images).",
    )  # fmt: skip
    # Checkpoints kept in the store; older ones are deleted there, their rows kept.
    keep_checkpoints: int | None = option(
        None, low=1, shown="every one",
        help="Keep this many newest checkpoints in the store; older ones are deleted (their "
        "rows stay, marked).",
    )  # fmt: skip
    # Besides the last checkpoint (and those with validation renders), a whole pipeline
    # is written every this many steps; other checkpoints hold the training state only.
    export_every: int | None = option(
        None, low=1,
        help="Also write a whole pipeline (a model `--model RUN@STEP` renders with) every this "
        "many steps. The last checkpoint and those with validation renders always are; the "
        "others hold the training state only.",
    )  # fmt: skip
    # Start from random weights instead of the base's: of the base's architecture, or of
    # `unet_config` (a diffusers U-Net config) when given (`--unet-config`, which names
    # one: producer/train/cli.py).
    from_scratch: bool = option(
        False, help="Random weights instead of the base's U-Net, drawn from --seed."
    )
    unet_config: dict[str, Any] | None = None
    # Aspect-ratio buckets (models/datasets/buckets.py): each global batch is one bucket's,
    # so every rank's micro-batch has one shape.
    buckets: bool = option(
        False, help="Train on the aspect-ratio buckets of --resolution's area (`sdq encode "
        "--buckets`): each global batch from one bucket, the buckets drawn from --seed in "
        "proportion to their samples.",
    )  # fmt: skip
    # LoRA (Hu et al. 2021): adapters of this rank train on the U-Net's layers and nothing
    # else does; the run's model is a LoRA file.
    lora_rank: int | None = option(
        None, low=1, shown="none: the whole U-Net trains",
        help="Train a LoRA of this rank on the U-Net instead of the whole U-Net: checkpoints "
        "hold the adapters and their optimizer state (megabytes), and the run's model is a "
        "LoRA file that `--lora NAME` renders with over its base.",
    )  # fmt: skip
    lora_alpha: float | None = option(
        None, low=0, above=True, shown="the rank",
        help="The LoRA's alpha: its update is scaled by alpha / rank.",
    )  # fmt: skip
    lora_targets: str = option(
        "attention", choices=LORA_TARGETS,
        help="The layers a LoRA adapts in the U-Net's transformer blocks: attention's query, "
        "key, value and output projections; attention+ff adds the feed-forward layers.",
    )  # fmt: skip
    ema: float | None = option(
        0.9999, low=0, high=1, above=True, below=True, zero_is_none=True,
        help="EMA decay; 0 keeps none.",
    )  # fmt: skip
    min_snr: float | None = option(
        5.0, low=0, above=True, zero_is_none=True, help="Min-SNR gamma; 0 for plain MSE."
    )
    seed: int = option(
        0, help="Decides the data order and the noise: a rerun makes the same model."
    )
    # "auto": bf16 on a GPU, none on a CPU (which has no fast half-precision kernels).
    mixed_precision: str = option(
        "auto", choices=MIXED_PRECISION,
        help="Autocast on the GPU (fp16 with a gradient scaler); auto is bf16 on a GPU and "
        "none on a CPU.",
    )  # fmt: skip
    gradient_checkpointing: bool = option(
        False, help="Recompute activations in the backward pass: less memory, more time."
    )
    compile: bool = option(False, help="torch.compile the U-Net.")

    def __post_init__(self) -> None:
        """Refuses options that cannot train, naming them: each against its declaration,
        then how the batch splits over ranks, lanes and micro-batches."""
        if self.data_lanes is None:
            object.__setattr__(self, "data_lanes", default_lanes(self.batch_size, self.world_size))
        refuse_undeclared(self)
        if self.unet_config is not None and not self.from_scratch:
            raise ValueError("--unet-config sets the architecture of a U-Net --from-scratch")
        self._check_split()
        self._check_lora()

    def _check_split(self) -> None:
        """The global batch splits evenly over nodes, ranks, lanes and micro-batches."""
        if self.batch_size % (self.world_size * self.grad_accumulation):
            raise ValueError(
                f"--batch-size {self.batch_size} must split into equal micro-batches: "
                f"a multiple of --world-size {self.world_size} x --grad-accumulation "
                f"{self.grad_accumulation}"
            )
        if self.world_size % self.nodes:
            raise ValueError(
                f"--world-size {self.world_size} must split evenly over --nodes {self.nodes}"
            )
        if self.batch_size % self.data_lanes or self.data_lanes % self.world_size:
            raise ValueError(
                f"--data-lanes {self.data_lanes} must divide --batch-size {self.batch_size} "
                f"and be a multiple of --world-size {self.world_size} (each rank reads whole lanes)"
            )
        if self.sharded and self.world_size == 1:
            raise ValueError(
                f"--sharding {self.sharding} spreads the state over ranks: give --world-size 2 "
                f"or more, or --sharding none"
            )

    def _check_lora(self) -> None:
        """A LoRA adapts a trained U-Net, and its state is small enough for every rank."""
        if self.lora_rank is None:
            if self.lora_alpha is not None or self.lora_targets != LORA_TARGETS[0]:
                raise ValueError("--lora-alpha and --lora-targets shape a LoRA: give --lora-rank")
            return
        if self.from_scratch:
            raise ValueError(
                "--lora-rank adapts a trained U-Net's weights; --from-scratch has none to adapt"
            )
        if self.sharded:
            raise ValueError(
                f"--lora-rank with --sharding {self.sharding}: a LoRA's trained state is its "
                f"adapters (megabytes), which every rank holds whole; give --sharding none"
            )

    @property
    def sharded(self) -> bool:
        return self.sharding != "none"

    @property
    def lora(self) -> bool:
        return self.lora_rank is not None

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nodes

    @property
    def micro_batch(self) -> int:
        """Samples in one forward pass of one rank."""
        return self.batch_size // (self.world_size * self.grad_accumulation)


# A job takes steps for this share of its task's time limit at most, then writes its
# checkpoint and leaves the rest of its steps to the next job: a job too long for the
# limit (a large --checkpoint-every on slow GPUs) ends early instead of being killed on
# every attempt. The rest of the limit is for the start, the restore and the checkpoint.
TRAINING_SHARE_OF_TIME_LIMIT = 0.8


def training_seconds(options: TrainOptions, time_limit_seconds: float | None) -> float | None:
    """How long a job takes steps at most, under a task time limit (None: no limit)."""
    bounds = [
        *([TRAINING_SHARE_OF_TIME_LIMIT * time_limit_seconds] if time_limit_seconds else []),
        *([60 * options.checkpoint_minutes] if options.checkpoint_minutes else []),
    ]
    return min(bounds, default=None)


def default_lanes(batch_size: int, world_size: int) -> int:
    """The most lanes, up to DEFAULT_MAX_LANES or the world size, that split the batch and
    that the world size divides (the world size itself always does)."""
    most = max(DEFAULT_MAX_LANES, world_size)
    fitting = range(world_size, most + 1, world_size)
    # The world size stands even when it does not split the batch: the options' own check
    # then says why, rather than this one failing on no candidate.
    return max(lanes for lanes in fitting if batch_size % lanes == 0 or lanes == world_size)


@dataclass(frozen=True, kw_only=True)
class LatentInput:
    """One latent shard a run reads, and how many samples it holds (of one aspect-ratio
    bucket, WIDTHxHEIGHT, in a run on buckets)."""

    uri: str
    key: str
    samples: int
    bucket: str | None = None


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
    # The run's latent shards, in order: in the store under `inputs_key`, written once at
    # submit (a run over LAION-2B's ~2M shards would copy ~42 MB into every job's spec).
    # Runs from before the manifest carry them here.
    inputs_key: str | None = None
    inputs: tuple[LatentInput, ...] = field(default=())
    # Images rendered from every checkpoint, so that a run's page shows how they change.
    validation: FixedRenders | None = None
    # The text encoder's output for "", which caption dropout trains on (the encode run
    # stores it beside the latents).
    empty_prompt_key: str | None = None
    # Where the run's first state comes from: a checkpoint prefix of an earlier run whose
    # weights it goes on from (another resolution's phase, say); None: the base model.
    start_from: str | None = None
    # What its checkpoints are scored by, on the evaluate queue (`--eval-metrics`).
    evaluation: Evaluation | None = None
    # The trackers its figures go to besides SQL (`--report-to`, workers/tracking.py).
    report_to: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def exports_model(self) -> bool:
        """Whether this job's checkpoint is also written as a model that generation can use
        (a whole pipeline, or a LoRA run's LoRA file): the run's last, one whose validation
        prompts are rendered, or one the export interval asks for. The others hold the
        training state only."""
        every = self.options.export_every
        return (
            self.last_step == self.options.steps
            or self.validation is not None
            or (every is not None and self.last_step % every == 0)
            or self.evaluates(self.last_step)
        )

    def evaluates(self, step: int) -> bool:
        """Whether this job's checkpoint at `step` is scored: the run's last, and one that
        passes a multiple of --eval-every-checkpoints checkpoints' steps (a job stopped
        early by its time limit shifts the later checkpoints' steps, not which are)."""
        if self.evaluation is None:
            return False
        period = self.evaluation.every * self.options.checkpoint_every
        return step == self.options.steps or step // period > self.first_step // period

    def next_after(self, step: int) -> "TrainShardSpec | None":
        """The run's job after this one ended at `step` (its last, or an earlier step where
        it stopped for its time limit); None after the run's last step."""
        if step >= self.options.steps:
            return None
        last = min(step + self.options.checkpoint_every, self.options.steps)
        return replace(self, first_step=step, last_step=last)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainShardSpec":
        validation = data.get("validation")
        nested = ("options", "inputs", "validation", "evaluation", "report_to")
        evaluation = data.get("evaluation")
        return cls(
            **{key: value for key, value in data.items() if key not in nested},
            # Runs from before data lanes read their shards in one lane.
            options=TrainOptions(**{"data_lanes": 1, **data["options"]}),
            inputs=tuple(LatentInput(**item) for item in data["inputs"]),
            validation=FixedRenders.from_dict(validation) if validation else None,
            evaluation=Evaluation.from_dict(evaluation) if evaluation else None,
            report_to=tuple(data.get("report_to", ())),
        )

    def hash(self) -> str:
        # The run is part of it: two runs never share checkpoints, whatever their options.
        return canonical_sha256({**self.to_dict(), "version": SPEC_VERSION})


def checkpoint_prefix(run: int, step: int) -> str:
    return f"train/{run}/checkpoints/{step:08d}"


def lora_file_key(model_prefix: str) -> str:
    """Where a LoRA run's checkpoint keeps its model, the LoRA file."""
    return f"{model_prefix}/{LORA_FILE}"
