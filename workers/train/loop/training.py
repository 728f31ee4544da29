"""A run's training on one rank, kept from job to job, the same in a worker process that
trains alone and in each process of a data-parallel group: its state, the stream of its
steps' inputs, the steps it takes in windows whose losses are read at once, and when to
stop (every rank after the same step, as rank 0 decides). It reads the object store only;
the database is the worker's (work.py). GPU-side: imports torch.

A checkpoint is written from a copy of the state in host memory, on a thread, while the
training goes on to the next job's steps (`Training.train_ahead`): the devices wait for
the copy, not for the upload. The next job, when it comes to the same process, takes the
steps already taken for it; anywhere else, it restores the checkpoint and takes them
again, the same steps (every sample and draw is a function of the seed and the step).
"""

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import replace
from time import perf_counter, time
from typing import Any

import torch
import torch.distributed as dist

from sdq.models.store import ObjectStore
from sdq.models.train.inputs import read_inputs_manifest
from sdq.models.train.settings import TrainSettings
from sdq.models.train.specs import LatentInput, TrainShardSpec
from sdq.workers.gpu import peak_flops
from sdq.workers.train.loop.checkpoints import Snapshot, snapshot
from sdq.workers.train.loop.data import BucketedStream, LatentStream, load_shards
from sdq.workers.train.loop.diverged import Diverged, DivergenceWatch
from sdq.workers.train.loop.sharding import ShardedSnapshot, sharded_snapshot
from sdq.workers.train.loop.state import TrainState
from sdq.workers.train.loop.step import (
    StepInputs,
    on_device,
    pinned_allocator,
    train_step,
    training_flops_per_sample,
)


def run_inputs(spec: TrainShardSpec, store: ObjectStore) -> tuple[LatentInput, ...]:
    """The run's latent shards: from its manifest, read once per process and run."""
    if spec.inputs_key is None:
        return spec.inputs
    if spec.inputs_key not in _manifests:
        _manifests.clear()  # one run at a time
        _manifests[spec.inputs_key] = read_inputs_manifest(store.get_large(spec.inputs_key))
    return _manifests[spec.inputs_key]


_manifests: dict[str, tuple[LatentInput, ...]] = {}


class Training:
    """A run's training on this rank, kept from job to job: its state, its step inputs (a
    stream that runs on across jobs: a step's samples and draws depend on the run's seed
    and the step alone), and the steps it has taken past its last checkpoint, ahead of the
    job they belong to (taken while that checkpoint was written, before the job came)."""

    def __init__(
        self,
        spec: TrainShardSpec,
        state: TrainState,
        store: ObjectStore,
        settings: TrainSettings,
        on_steps: Callable[[list[dict]], None] = lambda steps: None,
    ) -> None:
        self.state = state
        # Told each window's steps as their losses are read (LiveSteps writes them).
        self.on_steps = on_steps
        self.loss_every = settings.loss_every
        self._divergence = DivergenceWatch()
        self._diverged_ahead: Diverged | None = None
        self.checkpointed = state.step  # the step of the checkpoint the state is past
        self.ahead: list[dict] = []
        self._writing: ShardedSnapshot | None = None
        shards = run_inputs(spec, store)
        # The shapes its steps come in, on buckets: a compiled state's key holds them all.
        self._buckets = sorted({shard.bucket for shard in shards}) if spec.options.buckets else []
        stream = (BucketedStream if spec.options.buckets else LatentStream)(
            shards,
            seed=spec.options.seed,
            batch_size=spec.options.batch_size,
            lanes=spec.options.data_lanes,
            load=load_shards(shards, store.get_large),
            shards_ahead=settings.shards_ahead,
            threads=settings.fetch_threads,
            holdout=spec.options.holdout,
        )
        self._batches = stream.batches(
            state.step,
            state.ranks.lanes(spec.options.data_lanes),
            pinned_allocator(state.device),
            last_step=spec.options.steps,
        )
        self._inputs = on_device(self._batches, state, spec)

    def goes_on_to(self, spec: TrainShardSpec) -> bool:
        """Whether the job starts from the checkpoint written last, and every step this
        state has taken since is one of the job's."""
        return (spec.run, spec.first_step) == (self.state.run, self.checkpointed) and (
            self.state.step <= spec.last_step
        )

    def steps(self, spec: TrainShardSpec, stop: "Stop") -> list[dict]:
        """The job's steps: those taken ahead for it, then more up to its last (see
        `take_steps`)."""
        if self._diverged_ahead is not None:
            raise self._diverged_ahead
        steps, self.ahead = [*self.ahead, *self.take_steps(spec, stop)], []
        return steps

    def train_ahead(self, spec: TrainShardSpec, stop: "Stop") -> None:
        """Steps of the run's next job, before it comes (the same steps it would take). A
        divergence among them is that job's end, not the end of the one whose checkpoint
        is being written meanwhile."""
        try:
            self.ahead += self.take_steps(spec, stop)
        except Diverged as diverged:
            self._diverged_ahead = diverged

    def take_steps(self, spec: TrainShardSpec, stop: "Stop") -> list[dict]:
        """Steps up to the job's last, each one's loss, learning rate and speed noted (the
        loss and speed of the whole global batch, the same on every rank), until `stop`
        says so: it is asked, on every rank at once, each time a window of `loss_every`
        steps has its losses read from the device (all at once). A window's speed is its
        samples over its wall time: data waits count, not only the compute."""
        state = self.state
        window = StepWindow(spec, state)
        while state.step < spec.last_step:
            inputs = window.next_from(self._inputs)
            with self._first_compiled(spec, inputs, window):
                window.flops_from(spec, inputs)
                window.add(train_step(state, spec, inputs), inputs.bucket)
            if len(window) == self.loss_every:
                self._read(window)
                if stop():
                    break
        self._read(window)
        return window.steps

    def _read(self, window: "StepWindow") -> None:
        """The window's losses read, told on, and watched for a divergence (all ranks read
        the same global batch's losses, so all of them raise it at the same step)."""
        steps = window.read()
        self.on_steps(steps)
        self._divergence.see(steps)

    def _first_compiled(self, spec: TrainShardSpec, inputs, window: "StepWindow"):
        """Around a compiled state's first step of each shape (and its FLOP count): the
        store's artifacts loaded before the first, this rank 0's saved after each that
        compiled anything, and their time set aside from the window's speed (the first's is
        the run's start)."""
        state = self.state
        if state.compiled is None:
            return nullcontext()
        return state.compiled.first_of_shape(spec, state.unet, inputs, buckets=self._buckets,
                                             saves=state.ranks.writes,
                                             took=window.compiled_in)  # fmt: skip

    def checkpoint(self, spec: TrainShardSpec) -> Snapshot | ShardedSnapshot | None:
        """The state to write as the checkpoint at its step, on the rank that writes it (on
        every rank, each its part, when sharded); the training may go on from here at
        once."""
        state = self.state
        self.checkpointed = state.step
        if not state.sharded:
            return snapshot(state) if state.ranks.writes else None
        if self._writing is not None:
            # The last checkpoint's ranks gather on the group this one's writer uses.
            self._writing.uploaded.wait()
        exports = replace(spec, last_step=state.step).exports_model
        self._writing = sharded_snapshot(state, exports)
        return self._writing

    def close(self) -> None:
        self._inputs.close()
        self._batches.close()


# Whether to stop taking steps, asked of every rank at the same step (see rank0_decides).
Stop = Callable[[], bool]


def rank0_decides(decision: bool, state: TrainState) -> bool:
    """Rank 0's decision, for every rank: they all stop after the same step."""
    if not state.ranks.distributed:
        return decision
    decided = torch.tensor([decision], device=state.device)
    dist.broadcast(decided, src=0)
    return bool(decided.item())


def until_time(stop_at: float | None, state: TrainState) -> Stop:
    """Stops past `stop_at` (a time.time() on rank 0): the job then writes its checkpoint
    within the task's time limit, before its last step."""
    return lambda: rank0_decides(stop_at is not None and time() >= stop_at, state)


class StepWindow:
    """Steps whose losses are still on the device, read together when the window closes."""

    def __init__(self, spec: TrainShardSpec, state: TrainState) -> None:
        self.spec, self.state = spec, state
        self.steps: list[dict[str, Any]] = []
        self._losses: list[tuple[int, float, torch.Tensor]] = []
        self._opened, self._opened_at = perf_counter(), time()
        self._waited = 0.0
        self._compiled_in: list[float] = []  # the seconds of each step that compiled
        self._starting: float | None = None  # of those, the state's first step's
        self._peak = peak_flops(state.device)

    def __len__(self) -> int:
        return len(self._losses)

    def next_from(self, inputs: Iterator[StepInputs]) -> StepInputs:
        """The next step's inputs, the time spent waiting for them added to the window's."""
        started = perf_counter()
        step_inputs = next(inputs)
        self._waited += perf_counter() - started
        return step_inputs

    def flops_from(self, spec: TrainShardSpec, inputs: StepInputs) -> None:
        """The model's FLOPs per sample, counted once on the state's first batch (on a GPU)."""
        if self._peak is not None and self.state.flops_per_sample is None:
            self.state.flops_per_sample = training_flops_per_sample(
                self.state,
                spec,
                inputs.latents.float(),
                inputs.embeddings.float(),
                {name: tensor.float() for name, tensor in inputs.added.items()},
            )

    def compiled_in(self, seconds: float, starting: bool) -> None:
        """A step of the window (the first of its shape) compiled the model, taking
        `seconds` with its own work; `starting`: the state's first step."""
        self._compiled_in.append(seconds)
        if starting:
            self._starting = seconds

    def _compiling(self, elapsed: float, steps: int) -> tuple[float, float]:
        """Of the window's `elapsed` seconds, those its steps spent compiling (each such
        step's time less one step's: the others' mean), and of those, the state's first
        step's. A window whose every step compiled has no other step to tell them apart
        by: its compiles stay in its speed."""
        others = steps - len(self._compiled_in)
        if not self._compiled_in or others < 1:
            return 0.0, 0.0
        step = (elapsed - sum(self._compiled_in)) / others
        compiling = sum(max(0.0, seconds - step) for seconds in self._compiled_in)
        starting = 0.0 if self._starting is None else max(0.0, self._starting - step)
        return compiling, starting

    def add(self, loss: torch.Tensor, bucket: str | None) -> None:
        lr = self.state.lr_scheduler.get_last_lr()[0]
        self._losses.append((self.state.step, lr, loss, bucket))

    def read(self) -> list[dict[str, Any]]:
        """The window's steps, their losses read from the device at once."""
        if not self._losses:
            return []
        read_before = len(self.steps)
        losses = torch.stack([loss for _, _, loss, _ in self._losses]).tolist()
        closed, closed_at = perf_counter(), time()
        options = self.spec.options
        # Compiles are set aside from the speed. The state's first is the run's start too:
        # the first step begins once it is done (in the start share). A later shape's stays
        # in its step's time (the training share).
        compiling, starting = self._compiling(closed - self._opened, len(losses))
        speed = len(losses) * options.batch_size / (closed - self._opened - compiling)
        peak, flops = self._peak, self.state.flops_per_sample
        waited = self._waited / len(losses)
        began = self._opened_at + starting
        each = (closed_at - began) / len(losses)
        for n, ((step, lr, _, bucket), loss) in enumerate(
            zip(self._losses, losses, strict=True), 1
        ):
            self.steps.append(
                {
                    "run_id": self.spec.run,
                    "step": step,
                    "loss": loss,
                    "lr": lr,
                    "samples_per_second": speed,
                    "world_size": options.world_size,
                    "mfu": flops * speed / (peak * options.world_size) if flops else None,
                    "data_wait_seconds": waited,
                    "bucket": bucket,
                    # When it ended (a time.time()): the window's time shared evenly.
                    "at": began + n * each,
                }
            )
        self._losses, self._waited, self._compiled_in, self._starting = [], 0.0, [], None
        self._opened, self._opened_at = closed, closed_at
        return self.steps[read_before:]
