"""What only the train kind has: each run's inputs, its loss at every step, and its
checkpoints, each of them a model that generation can use."""

from datetime import datetime

from sqlalchemy import (
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    func,
)
from sqlalchemy.orm import Mapped, mapped_column

from sdq.models.tables import Base, Id


class TrainInput(Base):
    """A latent shard a train run reads: the link from a checkpoint back to its data."""

    __tablename__ = "train_inputs"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    latent_shard_id: Mapped[int] = mapped_column(
        ForeignKey("latent_shards.id", ondelete="CASCADE"), primary_key=True
    )


class HeldOutRow(Base):
    """A row of a run's latent shard that training never reads (`--holdout`,
    models/train/holdout.py), drawn at submit: lineage leaves it out of what the run
    learned from."""

    __tablename__ = "train_held_out"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    latent_shard_id: Mapped[int] = mapped_column(
        ForeignKey("latent_shards.id", ondelete="CASCADE"), primary_key=True
    )
    latent_row: Mapped[int] = mapped_column(Integer, primary_key=True)

    # A latent shard deleted (encoded again into other buckets) finds its rows here.
    __table_args__ = (Index("ix_train_held_out_latent_shard_id", "latent_shard_id"),)


class TrainStep(Base):
    """One optimizer step: what the loss curve and the throughput figures are made of."""

    __tablename__ = "train_steps"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    # None: not a finite number (a diverged run's, see workers/train/loop/diverged.py).
    loss: Mapped[float | None] = mapped_column(Float)
    lr: Mapped[float] = mapped_column(Float)
    samples_per_second: Mapped[float] = mapped_column(Float)  # of the whole global batch
    world_size: Mapped[int] = mapped_column(Integer, server_default="1")
    # Model FLOPs utilisation on a GPU whose peak is known; none on a CPU.
    mfu: Mapped[float | None] = mapped_column(Float)
    # The step's share of the time its window of steps waited for data (none recorded
    # before it was measured).
    data_wait_seconds: Mapped[float | None] = mapped_column(Float)
    # The aspect-ratio bucket of its batch, WIDTHxHEIGHT (a run on `--buckets`).
    bucket: Mapped[str | None] = mapped_column(Text)
    # When the step ended, by its rank's clock (steps recorded before that was: when they
    # reached the database).
    at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.current_timestamp()
    )


class Checkpoint(Base):
    """The state after `step`: everything to resume from (under `uri`, its files' hash
    `state_sha256`), and, for a checkpoint written as a model, the pipeline it makes
    (`model_prefix` in the store, registered under `model_revision`). A checkpoint past
    the run's --keep-checkpoints is deleted from the store; its row stays, `deleted_at` set."""

    __tablename__ = "checkpoints"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    uri: Mapped[str] = mapped_column(Text)
    state_sha256: Mapped[str | None] = mapped_column(String(64))
    model_prefix: Mapped[str | None] = mapped_column(Text)
    model_revision: Mapped[str | None] = mapped_column(String(64))
    # How long the training waited while it was written.
    write_seconds: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.current_timestamp()
    )
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        UniqueConstraint("run_id", "step", name="uq_checkpoints_run_id_step"),
        # From a generated image's model revision to the checkpoint that made it.
        Index("ix_checkpoints_model_revision", "model_revision"),
    )


class TrainGang(Base):
    """One node of a gathering of the gang that runs a train-shard job over several
    machines. The worker that claimed the job writes node 0 of a new gathering with the
    rendezvous address its rank 0 listens on; each worker that answers the job's call to
    join takes the next node, or, in a gang that goes on from the run's last job, the node
    its kept ranks are. Every node notes when it was last seen, by the database's clock."""

    __tablename__ = "train_gangs"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    # 1, 2, ... for each time the job's leader called for a gang: an outage gives the job
    # its attempt back, so the attempt does not tell two gatherings apart.
    gathering: Mapped[int] = mapped_column(Integer, primary_key=True)
    node: Mapped[int] = mapped_column(Integer, primary_key=True)
    worker: Mapped[str] = mapped_column(Text)
    # host:port of torch.distributed's store, on node 0; the node's own address on others.
    address: Mapped[str] = mapped_column(Text)
    seen_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    joined_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.current_timestamp()
    )
