"""One optimizer step and what it trains on. GPU-side: imports torch.

The next batch and its random draws are made on a thread and copied from pinned memory on a
side stream while the current step runs, and the loss stays on the device until the job
reads a window of them at once (training.py): the host never waits for the device within a
step.

Data parallel: each rank trains on its own slice of every global batch. A sample's random
draws (noise, timestep, offset noise, caption dropout) come from a generator seeded by the
run's seed, the step and the sample's place in the global batch: the same draws whatever
the world size (N ranks follow one rank's loss curve) and whatever the worker, with no
generator state to save (a resumed job draws what the first attempt drew).
"""

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers.training_utils import compute_snr

from sdq.models.ahead import run_ahead
from sdq.models.train.specs import TrainShardSpec
from sdq.workers.shards.latents import POOLED_CONDITION
from sdq.workers.train.loop.data import Batch
from sdq.workers.train.loop.lora import training_passes
from sdq.workers.train.loop.state import TrainState


@dataclass(frozen=True)
class Draws:
    """A step's random numbers for this rank's samples."""

    noise: torch.Tensor
    timesteps: torch.Tensor
    dropped: torch.Tensor | None  # samples trained on the empty prompt


@dataclass(frozen=True)
class StepInputs:
    """What one step trains on, on the device: this rank's samples and their draws."""

    latents: torch.Tensor  # as the shards store them (fp16 from a GPU's encode)
    embeddings: torch.Tensor
    draws: Draws
    bucket: str | None = None  # its aspect-ratio bucket, WIDTHxHEIGHT, on buckets
    # An SDXL U-Net's added conditions (`text_embeds`, `time_ids`; none for SD).
    added: dict[str, torch.Tensor] = field(default_factory=dict)


def sample_seed(seed: int, step: int, index: int) -> int:
    """The seed of sample `index` of the global batch of `step` (1-based)."""
    digest = hashlib.blake2b(f"{seed}/{step}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def draw(spec: TrainShardSpec, step: int, part: slice, sample_shape: torch.Size) -> Draws:
    """The draws of samples `part` of the global batch of `step`, each from its own CPU
    generator: the same numbers on any device, world size and worker."""
    options = spec.options
    total = spec.scheduler_config.get("num_train_timesteps", 1000)
    noises, timesteps, dropped = [], [], []
    for index in range(part.start, part.stop):
        generator = torch.Generator().manual_seed(sample_seed(options.seed, step, index))
        noise = torch.randn(sample_shape, generator=generator)
        timesteps.append(torch.randint(0, total, (), generator=generator))
        if options.noise_offset:
            offset = torch.randn((sample_shape[0], 1, 1), generator=generator)
            noise = noise + options.noise_offset * offset
        noises.append(noise)
        if options.caption_dropout:
            dropped.append(torch.rand((), generator=generator) < options.caption_dropout)
    return Draws(
        noise=torch.stack(noises),
        timesteps=torch.stack(timesteps),
        dropped=torch.stack(dropped) if dropped else None,
    )


def step_inputs(
    state: TrainState, spec: TrainShardSpec, latents, embeddings, added=None
) -> StepInputs:
    """The next step's inputs from host tensors, drawn and moved here and now."""
    part = state.ranks.part(spec.options.batch_size)
    draws = draw(spec, state.step + 1, part, latents.shape[1:])
    return _moved(StepInputs(latents, embeddings, draws, added=added or {}), state.device)


def on_device(
    batches: Iterator[Batch], state: TrainState, spec: TrainShardSpec
) -> Iterator[StepInputs]:
    """Each batch with its draws, made on a thread and copied to the device on a side
    stream (from pinned memory: the batch is gathered there) while the step before runs;
    each is handed over once its copies are done."""
    part = state.ranks.part(spec.options.batch_size)
    side = torch.cuda.Stream(state.device) if state.device.type == "cuda" else None

    def staged(batch: Batch) -> StepInputs:
        latents = torch.from_numpy(batch.latents)
        draws = draw(spec, batch.step, part, latents.shape[1:])
        embeddings = torch.from_numpy(batch.text_embeddings)
        added = {name: torch.from_numpy(array) for name, array in batch.added.items()}
        host = StepInputs(latents, embeddings, _pinned(draws, side), batch.bucket, added)
        if side is None:
            return _moved(host, state.device)
        with torch.cuda.stream(side):
            moved = _moved(host, state.device)
        # This thread, not the step's, waits for the copies: then the host buffers may go.
        side.synchronize()
        return moved

    for inputs in run_ahead((staged(batch) for batch in batches), depth=2):
        if side is not None:
            _used_here(inputs)
        yield inputs


def pinned_allocator(device: torch.device):
    """Where a batch is gathered on the host: pinned memory when it goes to a GPU."""
    if device.type != "cuda":
        return np.empty

    def allocate(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        like = torch.from_numpy(np.empty(0, dtype)).dtype
        return torch.empty(shape, dtype=like, pin_memory=True).numpy()

    return allocate


def _pinned(draws: Draws, side) -> Draws:
    if side is None:
        return draws
    dropped = draws.dropped.pin_memory() if draws.dropped is not None else None
    return Draws(draws.noise.pin_memory(), draws.timesteps.pin_memory(), dropped)


def _moved(inputs: StepInputs, device: torch.device) -> StepInputs:
    def move(tensor):
        return None if tensor is None else tensor.to(device, non_blocking=True)

    draws = inputs.draws
    return StepInputs(
        move(inputs.latents),
        move(inputs.embeddings),
        Draws(move(draws.noise), move(draws.timesteps), move(draws.dropped)),
        inputs.bucket,
        {name: move(tensor) for name, tensor in inputs.added.items()},
    )


def _used_here(inputs: StepInputs) -> None:
    """Tensors made on the side stream, used on the step's: the allocator must not hand
    their memory to the side stream again before the step's work on them is done."""
    here = torch.cuda.current_stream(inputs.latents.device)
    draws = inputs.draws
    tensors = (inputs.latents, inputs.embeddings, draws.noise, draws.timesteps, draws.dropped)
    for tensor in (*tensors, *inputs.added.values()):
        if tensor is not None:
            tensor.record_stream(here)


def train_step(state: TrainState, spec: TrainShardSpec, inputs: StepInputs) -> torch.Tensor:
    """One optimizer step on this rank's share of the global batch, in micro-batches whose
    gradients add up (synchronised across ranks on the last); returns the loss of the
    whole global batch, on the device: reading it waits for the step, so callers read a
    window of steps at once."""
    options = spec.options
    draws = inputs.draws
    latents, embeddings = inputs.latents.float(), inputs.embeddings.float()
    added = {name: tensor.float() for name, tensor in inputs.added.items()}
    # Anything else random in the model (dropout in a custom architecture) is seeded too.
    torch.manual_seed(sample_seed(options.seed, state.step + 1, -1 - state.ranks.rank))
    if draws.dropped is not None:
        embeddings = torch.where(draws.dropped[:, None, None], state.empty_prompt, embeddings)
        if added:  # SDXL: the empty prompt's pooled embedding too
            pooled = added[POOLED_CONDITION]
            added[POOLED_CONDITION] = torch.where(
                draws.dropped[:, None], state.empty_pooled, pooled
            )
    micro = options.micro_batch
    total = torch.zeros((), device=state.device)
    state.optimizer.zero_grad(set_to_none=True)
    for start in range(0, latents.shape[0], micro):
        part = slice(start, start + micro)
        last = start + micro >= latents.shape[0]
        # Gradients are averaged across ranks once per step, on the last micro-batch.
        syncing = last or not state.ranks.distributed
        with nullcontext() if syncing else _gradients_kept_here(state):
            conditions = {name: tensor[part] for name, tensor in added.items()}
            loss = _micro_loss(state, spec, latents[part], embeddings[part], draws, part,
                               added=conditions)  # fmt: skip
            loss = loss / options.grad_accumulation
            _backward(state, loss)
        total += loss.detach()
    _optimizer_step(state, options.max_grad_norm)
    state.step += 1
    if state.ranks.distributed:
        dist.all_reduce(total)
        total /= state.ranks.world_size
    return total


@contextmanager
def _gradients_kept_here(state: TrainState) -> Iterator[None]:
    """Micro-batches' gradients added up on this rank, not yet averaged across ranks."""
    if not state.sharded:
        with state.model.no_sync():
            yield
        return
    state.unet.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        state.unet.set_requires_gradient_sync(True)


def _micro_loss(state: TrainState, spec: TrainShardSpec, latents, embeddings, draws, part, *,
                added: dict[str, torch.Tensor]):  # fmt: skip
    scheduler = state.noise_scheduler
    noise, timesteps = draws.noise[part], draws.timesteps[part]
    noisy = scheduler.add_noise(latents, noise, timesteps)
    if spec.prediction_type == "v_prediction":
        target = scheduler.get_velocity(latents, noise, timesteps)
    else:
        target = noise
    precision = autocast_dtype(spec.options.mixed_precision, state.device)
    with torch.autocast(state.device.type, dtype=precision, enabled=precision is not None):
        prediction = state.model(
            noisy, timesteps, embeddings, added_cond_kwargs=added or None
        ).sample
    return _loss(prediction.float(), target.float(), timesteps, spec, scheduler)


def _backward(state: TrainState, loss: torch.Tensor) -> None:
    if state.scaler is not None:
        state.scaler.scale(loss).backward()
    else:
        loss.backward()


def _optimizer_step(state: TrainState, max_grad_norm: float | None) -> None:
    if state.scaler is not None:
        if max_grad_norm is not None:
            state.scaler.unscale_(state.optimizer)  # clip the true gradients, not scaled ones
            torch.nn.utils.clip_grad_norm_(state.unet.parameters(), max_grad_norm)
        state.scaler.step(state.optimizer)
        state.scaler.update()
    else:
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(state.unet.parameters(), max_grad_norm)
        state.optimizer.step()
    state.lr_scheduler.step()
    if state.ema is not None:
        state.ema.step(state.trained)


def _loss(prediction, target, timesteps, spec: TrainShardSpec, scheduler) -> torch.Tensor:
    """MSE, or with min-SNR weighting (Hang et al. 2023) as diffusers' scripts do it."""
    if spec.options.min_snr is None:
        return F.mse_loss(prediction, target)
    snr = compute_snr(scheduler, timesteps)
    weights = torch.clamp(snr, max=spec.options.min_snr)
    weights = weights / (snr + 1) if spec.prediction_type == "v_prediction" else weights / snr
    per_sample = F.mse_loss(prediction, target, reduction="none").mean(dim=[1, 2, 3])
    return (per_sample * weights).mean()


def training_flops_per_sample(
    state: TrainState, spec: TrainShardSpec, latents, embeddings, added=None
) -> float:
    """The U-Net's FLOPs to train on one sample: its forward pass, at the run's precision,
    counted by torch's FLOP counter, times the passes a step makes of it (the model-FLOPs
    convention: recomputed activations do not count)."""
    from torch.utils.flop_counter import FlopCounterMode

    timesteps = torch.zeros((1,), dtype=torch.long, device=state.device)
    counter = FlopCounterMode(display=False)
    precision = autocast_dtype(spec.options.mixed_precision, state.device)
    autocast = torch.autocast(state.device.type, dtype=precision, enabled=precision is not None)
    with torch.no_grad(), autocast, counter:
        conditions = {name: tensor[:1] for name, tensor in (added or {}).items()}
        state.unet(latents[:1], timesteps, embeddings[:1], added_cond_kwargs=conditions or None)
    return training_passes(state.lora) * counter.get_total_flops()


AUTOCAST = {"fp16": torch.float16, "bf16": torch.bfloat16}


def autocast_dtype(mixed_precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype the forward pass autocasts to; None: fp32 throughout."""
    if mixed_precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return AUTOCAST.get(mixed_precision)
