"""One train-shard job's work on one rank, the same in a worker process that trains alone
and in each process of a data-parallel group: restore the state, take the steps, write
the checkpoint (rank 0). It reads and writes the object store only; the database is the
worker's (work.py). GPU-side: imports torch.
"""

import io
import tempfile
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import replace
from pathlib import Path
from time import perf_counter, time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from diffusers import UNet2DConditionModel

from sdq.models.registry import folder_content_hash
from sdq.models.settings import TrainSettings
from sdq.models.store import ObjectStore
from sdq.models.training import (
    LatentInput,
    TrainShardSpec,
    checkpoint_prefix,
    read_inputs_manifest,
)
from sdq.workers.gpu import peak_flops
from sdq.workers.train.data import LatentStream, load_shards
from sdq.workers.train.records import Written
from sdq.workers.train.trainer import (
    Ranks,
    StepInputs,
    TrainState,
    base_folder,
    base_unet,
    export_model,
    load_checkpoint,
    new_state,
    on_device,
    pinned_allocator,
    save_checkpoint,
    train_step,
    training_flops_per_sample,
)
from sdq.workers.weights import ModelFiles


def restore_state(
    spec: TrainShardSpec, store: ObjectStore, files: ModelFiles, ranks: Ranks
) -> TrainState:
    """The state the job starts from: the run's first (the base's U-Net, a new one, or the
    weights of the checkpoint the run goes on from), or its checkpoint at the first step."""
    if spec.first_step == 0:
        state = new_state(spec, _first_unet(spec, store, files), ranks)
    else:
        prefix = f"{checkpoint_prefix(spec.run, spec.first_step)}/state/"
        with downloaded(store, prefix) as folder:
            state = load_checkpoint(spec, folder, ranks)
    if spec.options.caption_dropout:
        state.empty_prompt = empty_prompt(store, spec.empty_prompt_key).to(state.device)
    return state


def _first_unet(spec: TrainShardSpec, store: ObjectStore, files: ModelFiles):
    if spec.start_from is None:
        return base_unet(spec, files)
    with downloaded(store, f"{spec.start_from}/state/unet/") as folder:
        return UNet2DConditionModel.from_pretrained(folder)


@contextmanager
def downloaded(store: ObjectStore, prefix: str) -> Iterator[Path]:
    """The objects under a prefix, in a local folder while the block runs."""
    with tempfile.TemporaryDirectory(prefix="sdq-checkpoint-") as folder:
        for key in store.list_keys(prefix):
            store.get_file(key, Path(folder) / key.removeprefix(prefix))
        yield Path(folder)


def empty_prompt(store: ObjectStore, key: str | None) -> torch.Tensor:
    """The text encoder's output for "" (tokens x hidden size), as the encode run stored it."""
    if key is None:
        raise ValueError("caption dropout needs the empty prompt's embedding; the spec has none")
    return torch.from_numpy(np.load(io.BytesIO(store.get_bytes(key))).astype(np.float32))


def run_inputs(spec: TrainShardSpec, store: ObjectStore) -> tuple[LatentInput, ...]:
    """The run's latent shards: from its manifest, read once per process and run."""
    if spec.inputs_key is None:
        return spec.inputs
    if spec.inputs_key not in _manifests:
        _manifests.clear()  # one run at a time
        _manifests[spec.inputs_key] = read_inputs_manifest(store.get_large(spec.inputs_key))
    return _manifests[spec.inputs_key]


_manifests: dict[str, tuple[LatentInput, ...]] = {}


def train_steps(
    spec: TrainShardSpec,
    state: TrainState,
    store: ObjectStore,
    settings: TrainSettings,
    stop_at: float | None = None,
) -> list[dict]:
    """Steps until the job's last, each one's loss, learning rate and speed noted (the
    loss and speed of the whole global batch, the same on every rank). The losses are read
    from the device every `loss_every` steps, all at once, and a window's speed is its
    samples over its wall time: data waits count, not only the compute. Past `stop_at`
    (a time.time() on rank 0) the job stops at the next window's end, before its last
    step, so that its checkpoint is written within the task's time limit."""
    options = spec.options
    shards = run_inputs(spec, store)
    stream = LatentStream(
        shards,
        seed=options.seed,
        batch_size=options.batch_size,
        lanes=options.data_lanes,
        load=load_shards(shards, store.get_large),
        shards_ahead=settings.shards_ahead,
        threads=settings.fetch_threads,
    )
    batches = stream.batches(
        state.step, state.ranks.lanes(options.data_lanes), pinned_allocator(state.device)
    )
    window = StepWindow(spec, state)
    with closing(batches), closing(on_device(batches, state, spec)) as inputs:
        for step_inputs in window.waited_for(inputs):
            window.flops_from(step_inputs)
            window.add(train_step(state, spec, step_inputs))
            if state.step == spec.last_step:
                break
            if len(window) == settings.loss_every:
                window.read()
                if time_is_up(stop_at, state):
                    break
    window.read()
    return window.steps


def time_is_up(stop_at: float | None, state: TrainState) -> bool:
    """Rank 0's clock decides, for every rank: they all stop after the same step."""
    up = stop_at is not None and time() >= stop_at
    if not state.ranks.distributed:
        return up
    decided = torch.tensor([up], device=state.device)
    dist.broadcast(decided, src=0)
    return bool(decided.item())


class StepWindow:
    """Steps whose losses are still on the device, read together when the window closes."""

    def __init__(self, spec: TrainShardSpec, state: TrainState) -> None:
        self.spec, self.state = spec, state
        self.steps: list[dict[str, Any]] = []
        self._losses: list[tuple[int, float, torch.Tensor]] = []
        self._opened = perf_counter()
        self._waited = 0.0
        self._peak = peak_flops(state.device)

    def __len__(self) -> int:
        return len(self._losses)

    def waited_for(self, inputs: Iterator[StepInputs]) -> Iterator[StepInputs]:
        """The inputs, the time spent waiting for each added to the window's."""
        while True:
            started = perf_counter()
            step_inputs = next(inputs, None)
            self._waited += perf_counter() - started
            if step_inputs is None:
                return
            yield step_inputs

    def flops_from(self, inputs: StepInputs) -> None:
        """The model's FLOPs per sample, counted once on the state's first batch (on a GPU)."""
        if self._peak is not None and self.state.flops_per_sample is None:
            self.state.flops_per_sample = training_flops_per_sample(
                self.state, inputs.latents.float(), inputs.embeddings.float()
            )

    def add(self, loss: torch.Tensor) -> None:
        lr = self.state.lr_scheduler.get_last_lr()[0]
        self._losses.append((self.state.step, lr, loss))

    def read(self) -> None:
        if not self._losses:
            return
        losses = torch.stack([loss for _, _, loss in self._losses]).tolist()
        closed = perf_counter()
        options = self.spec.options
        speed = len(losses) * options.batch_size / (closed - self._opened)
        peak, flops = self._peak, self.state.flops_per_sample
        waited = self._waited / len(losses)
        for (step, lr, _), loss in zip(self._losses, losses, strict=True):
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
                }
            )
        self._losses, self._opened, self._waited = [], closed, 0.0


def write_checkpoint(
    spec: TrainShardSpec, state: TrainState, store: ObjectStore, files: ModelFiles
) -> Written:
    """The training state in the store, and the whole pipeline beside it when this
    checkpoint is a model."""
    started = perf_counter()
    prefix = checkpoint_prefix(spec.run, state.step)
    model_prefix, revision = None, None
    with tempfile.TemporaryDirectory(prefix="sdq-checkpoint-") as temporary:
        folder = Path(temporary)
        save_checkpoint(state, folder / "state")
        state_sha256 = folder_content_hash(folder / "state")
        # At the step the job reached, which is its last unless it stopped early.
        if replace(spec, last_step=state.step).exports_model:
            base = base_folder(spec, files, files.cache_dir)
            revision = export_model(state, base, folder / "model")
            model_prefix = f"{prefix}/model"
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                store.put_file(f"{prefix}/{path.relative_to(folder).as_posix()}", path)
    seconds = perf_counter() - started
    return Written(state.step, store.uri(prefix), state_sha256, model_prefix, revision, seconds)
