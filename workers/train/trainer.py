"""Fitting a U-Net on latents: the training state, one optimizer step, and checkpoints
that hold everything needed to go on exactly where they were written. GPU-side: imports
torch. The frozen VAE and text encoder are never loaded: the latent shards hold their
outputs.

On a GPU: bf16 autocast unless the run asks for fp16 (with a gradient scaler) or none, TF32
for what runs in fp32, cuDNN's autotuner, SDPA attention (diffusers' default processor),
fused AdamW, optional gradient checkpointing and torch.compile, channels_last. The next
batch and its random draws are made on a thread and copied from pinned memory on a side
stream while the current step runs, and the loss stays on the device until the job reads a
window of them at once: the host never waits for the device within a step. On a CPU the
same code runs in fp32.

Data parallel: with more than one rank the U-Net is wrapped in DistributedDataParallel and
each rank trains on its own slice of every global batch. A sample's random draws (noise,
timestep, offset noise, caption dropout) come from a generator seeded by the run's seed,
the step and the sample's place in the global batch: the same draws whatever the world size
(N ranks follow one rank's loss curve) and whatever the worker, with no generator state to
save (a resumed job draws what the first attempt drew).
"""

import hashlib
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DConditionModel
from diffusers.configuration_utils import FrozenDict
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel, compute_snr
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from sdq.models import tiny
from sdq.models.train.specs import TrainShardSpec
from sdq.workers.ahead import run_ahead
from sdq.workers.tiny import build_pipeline, build_unet
from sdq.workers.train.data import Batch
from sdq.workers.train.sharding import is_sharded, restore, shard, state_group
from sdq.workers.train.state import ALONE, Ranks, TrainState
from sdq.workers.train.statefile import UNET_FOLDER, load_state, save_state, save_unet
from sdq.workers.weights import ModelFiles, check_tiny_revision

AUTOCAST = {"fp16": torch.float16, "bf16": torch.bfloat16}
# diffusers' schedule names for --lr-schedule, each with --lr-warmup steps first.
LR_SCHEDULERS = {"constant": "constant_with_warmup", "cosine": "cosine", "linear": "linear"}


def base_unet(spec: TrainShardSpec, files: ModelFiles) -> UNet2DConditionModel:
    """The U-Net step 1 starts from: the base model's, or a new one of the configured
    architecture, its weights drawn from the run's seed (the same on every machine)."""
    options = spec.options
    if options.from_scratch:
        config = options.unet_config or _base_unet_config(spec, files)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(options.seed)
            return UNet2DConditionModel.from_config(config)
    if spec.base_source == tiny.TINY_NAME:
        check_tiny_revision(spec.base_revision)
        return build_unet()
    where = files.locate(spec.base_source, spec.base_revision)
    return UNet2DConditionModel.from_pretrained(
        where.path, subfolder=UNET_FOLDER, revision=where.revision
    )


def _base_unet_config(spec: TrainShardSpec, files: ModelFiles) -> dict:
    if spec.base_source == tiny.TINY_NAME:
        return tiny.UNET_CONFIG
    where = files.locate(spec.base_source, spec.base_revision)
    return UNet2DConditionModel.load_config(
        where.path, subfolder=UNET_FOLDER, revision=where.revision
    )


def autocast_dtype(mixed_precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype the forward pass autocasts to; None: fp32 throughout."""
    if mixed_precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return AUTOCAST.get(mixed_precision)


def use_fast_kernels(device: torch.device) -> None:
    """TF32 tensor cores for the matmuls and convolutions that still run in fp32, and
    cuDNN's autotuner: a training job's shapes never change."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True


def new_state(spec: TrainShardSpec, unet: UNet2DConditionModel, ranks: Ranks = ALONE) -> TrainState:
    """The state before step 1, around the base model's U-Net (one laid out on the meta
    device takes this rank's memory only for what it holds, to be restored into)."""
    options = spec.options
    device = ranks.device()
    use_fast_kernels(device)
    # 1. The U-Net on this rank's device: whole, or sharded over the ranks.
    unet = _placed(_without_origin(unet), device, channels_last=not options.sharded)
    if options.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    sharded = options.sharded and ranks.distributed
    if sharded:
        shard(unet, options.sharding, options.grad_comm, device)
    if unet.device.type == "meta":
        unet.to_empty(device=device)
    # 2. What trains it: AdamW (fused: one kernel for every parameter's update, on a GPU
    # and on the CPU, where its default loops over the parameters), the EMA.
    optimizer = torch.optim.AdamW(unet.parameters(), lr=options.lr, fused=True)
    ema = _ema(unet, options.ema) if options.ema is not None and (ranks.writes or sharded) else None
    # 3. What the steps call: DDP's wrapper over several unsharded ranks, compiled if asked.
    model = unet if sharded or not ranks.distributed else _data_parallel(unet, options, device)
    return TrainState(
        run=spec.run,
        step=0,
        unet=unet,
        model=torch.compile(model) if options.compile else model,
        optimizer=optimizer,
        lr_scheduler=get_scheduler(
            LR_SCHEDULERS[options.lr_schedule],
            optimizer,
            num_warmup_steps=options.lr_warmup,
            num_training_steps=options.steps,
        ),
        ema=ema,
        scaler=torch.amp.GradScaler(device.type) if options.mixed_precision == "fp16" else None,
        noise_scheduler=DDPMScheduler.from_config(
            {**spec.scheduler_config, "prediction_type": spec.prediction_type}
        ),
        device=device,
        ranks=ranks,
        checkpoint_group=state_group() if sharded else None,
    )


def _ema(unet: UNet2DConditionModel, decay: float) -> EMAModel:
    """EMA weights of the U-Net's parameters (this rank's shards, when sharded: every rank
    keeps its own; else rank 0 keeps them all), updated with foreach ops."""
    return LerpEMA(
        unet.parameters(),
        decay=decay,
        foreach=True,
        model_cls=UNet2DConditionModel,
        model_config=unet.config,
    )


class LerpEMA(EMAModel):
    """diffusers' EMA (its decay schedule, state dict and weights), each step's update one
    foreach lerp, `shadow += (1 - decay) * (param - shadow)`, where EMAModel's foreach path
    first writes `shadow - param` to a copy of every weight and reads it back (on the CPU,
    with SD 2's U-Net at a tenth of its width, 8 samples a step: 76.6 samples/s against
    73.3, medians of three)."""

    @torch.no_grad()
    def step(self, parameters) -> None:
        self.optimization_step += 1
        self.cur_decay_value = self.get_decay(self.optimization_step)
        torch._foreach_lerp_(self.shadow_params, list(parameters), 1 - self.cur_decay_value)


def _placed(unet: UNet2DConditionModel, device: torch.device, channels_last: bool):
    """The U-Net in fp32 on the device, in training mode; channels_last on a GPU (not when
    sharded: FSDP2 shards each weight along its first dimension, contiguous)."""
    if unet.device.type != "meta":
        unet = unet.to(device, torch.float32)
    if device.type == "cuda" and channels_last:
        unet = unet.to(memory_format=torch.channels_last)
    return unet.train()


def _data_parallel(unet: UNet2DConditionModel, options, device: torch.device):
    """The U-Net under DDP. Rank 0's weights are broadcast to the others here: all start
    alike. Gradients live in DDP's buckets (no copy in and out), and the graph is the same
    every step (which DDP cannot use beside no_sync: an internal assert fails in its
    reducer)."""
    model = DistributedDataParallel(
        unet,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
        static_graph=options.grad_accumulation == 1,
    )
    if options.grad_comm == "bf16":
        model.register_comm_hook(None, _bf16_gradients)
    return model


def _bf16_gradients(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's bf16_compress_hook (a bucket averaged in bf16, then cast back), without its
    check that the backend is NCCL: gloo's CPU ranks reduce bf16 as well."""
    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


def _without_origin(unet: UNet2DConditionModel) -> UNet2DConditionModel:
    """The U-Net with a config that does not name the folder it was loaded from: saved, that
    path would make two checkpoints of equal weights hash apart. The frozen config is
    replaced whole, as diffusers itself does: the model is not built again."""
    if "_name_or_path" in unet.config:
        config = {key: value for key, value in unet.config.items() if key != "_name_or_path"}
        unet._internal_dict = FrozenDict(config)
    return unet


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


def step_inputs(state: TrainState, spec: TrainShardSpec, latents, embeddings) -> StepInputs:
    """The next step's inputs from host tensors, drawn and moved here and now."""
    part = state.ranks.part(spec.options.batch_size)
    draws = draw(spec, state.step + 1, part, latents.shape[1:])
    return _moved(StepInputs(latents, embeddings, draws), state.device)


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
        host = StepInputs(latents, torch.from_numpy(batch.text_embeddings), _pinned(draws, side))
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
    )


def _used_here(inputs: StepInputs) -> None:
    """Tensors made on the side stream, used on the step's: the allocator must not hand
    their memory to the side stream again before the step's work on them is done."""
    here = torch.cuda.current_stream(inputs.latents.device)
    draws = inputs.draws
    for tensor in (inputs.latents, inputs.embeddings, draws.noise, draws.timesteps, draws.dropped):
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
    # Anything else random in the model (dropout in a custom architecture) is seeded too.
    torch.manual_seed(sample_seed(options.seed, state.step + 1, -1 - state.ranks.rank))
    if draws.dropped is not None:
        embeddings = torch.where(draws.dropped[:, None, None], state.empty_prompt, embeddings)
    micro = options.micro_batch
    total = torch.zeros((), device=state.device)
    state.optimizer.zero_grad(set_to_none=True)
    for start in range(0, latents.shape[0], micro):
        part = slice(start, start + micro)
        last = start + micro >= latents.shape[0]
        # Gradients are averaged across ranks once per step, on the last micro-batch.
        syncing = last or not state.ranks.distributed
        with nullcontext() if syncing else _gradients_kept_here(state):
            loss = _micro_loss(state, spec, latents[part], embeddings[part], draws, part)
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


def _micro_loss(state: TrainState, spec: TrainShardSpec, latents, embeddings, draws, part):
    scheduler = state.noise_scheduler
    noise, timesteps = draws.noise[part], draws.timesteps[part]
    noisy = scheduler.add_noise(latents, noise, timesteps)
    if spec.prediction_type == "v_prediction":
        target = scheduler.get_velocity(latents, noise, timesteps)
    else:
        target = noise
    precision = autocast_dtype(spec.options.mixed_precision, state.device)
    with torch.autocast(state.device.type, dtype=precision, enabled=precision is not None):
        prediction = state.model(noisy, timesteps, embeddings).sample
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
        state.ema.step(state.unet.parameters())


def _loss(prediction, target, timesteps, spec: TrainShardSpec, scheduler) -> torch.Tensor:
    """MSE, or with min-SNR weighting (Hang et al. 2023) as diffusers' scripts do it."""
    if spec.options.min_snr is None:
        return F.mse_loss(prediction, target)
    snr = compute_snr(scheduler, timesteps)
    weights = torch.clamp(snr, max=spec.options.min_snr)
    weights = weights / (snr + 1) if spec.prediction_type == "v_prediction" else weights / snr
    per_sample = F.mse_loss(prediction, target, reduction="none").mean(dim=[1, 2, 3])
    return (per_sample * weights).mean()


@dataclass(frozen=True)
class Snapshot:
    """The training state at one step, copied to host memory: what a checkpoint writes, from
    a thread, while the training goes on from the same state on the device."""

    step: int
    unet_config: dict
    unet: dict[str, torch.Tensor]  # the U-Net's state dict
    # The optimizer's, learning rate scheduler's, EMA's and gradient scaler's state dicts.
    training: dict[str, Any]
    # The U-Net's state dict with the EMA's weights (the same tensors as its state dict's).
    ema_unet: dict[str, torch.Tensor] | None
    seconds: float  # how long the training waited for the copy

    @property
    def model_weights(self) -> dict[str, torch.Tensor]:
        """The U-Net's weights a model made from this checkpoint has: the EMA's, when kept."""
        return self.unet if self.ema_unet is None else self.ema_unet


def snapshot(state: TrainState) -> Snapshot:
    """The state's copy on the host, into pinned memory from a GPU (one wait for all the
    copies), contiguous as safetensors writes it."""
    started = perf_counter()
    unet = _host_copies(state.unet.state_dict(), state.device)
    training = _host_copies(
        {
            "optimizer": state.optimizer.state_dict(),
            "lr_scheduler": state.lr_scheduler.state_dict(),
            "ema": state.ema.state_dict() if state.ema is not None else None,
            "scaler": state.scaler.state_dict() if state.scaler is not None else None,
        },
        state.device,
    )
    if state.device.type == "cuda":
        torch.cuda.synchronize(state.device)
    ema_unet = None
    if state.ema is not None:
        # One shadow per parameter, in the U-Net's parameter order.
        names = [name for name, _ in state.unet.named_parameters()]
        shadows = training["ema"]["shadow_params"]
        ema_unet = {**unet, **dict(zip(names, shadows, strict=True))}
    return Snapshot(
        state.step,
        dict(state.unet.config),
        unet,
        training,
        ema_unet,
        seconds=perf_counter() - started,
    )


def _host_copies(value: Any, device: torch.device) -> Any:
    """A state dict with its tensors copied to the host and its containers copied too: the
    live ones change with the next step."""
    if isinstance(value, torch.Tensor):
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=device.type == "cuda")
        return host.copy_(value.detach(), non_blocking=True)
    if isinstance(value, dict):
        return {key: _host_copies(item, device) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_host_copies(item, device) for item in value)
    return value


def save_checkpoint(snapshot: Snapshot, folder: Path) -> None:
    """The U-Net as diffusers saves it, and the rest of the training state beside it. No
    generator state: every draw is a function of the seed and the step, so the same run
    writes the same bytes, and any world size can go on from it."""
    save_unet(snapshot.unet_config, snapshot.unet, folder / UNET_FOLDER)
    save_state({"step": snapshot.step, **snapshot.training}, folder)


def load_checkpoint(spec: TrainShardSpec, folder: Path, ranks: Ranks = ALONE) -> TrainState:
    """The state a checkpoint folder holds, as it was when written."""
    if is_sharded(folder):
        state = new_state(spec, _laid_out(folder), ranks)
        restore(state, folder)
        return state
    state = new_state(spec, UNet2DConditionModel.from_pretrained(folder / UNET_FOLDER), ranks)
    saved = load_state(folder, state.device)
    state.step = saved["step"]
    restore_optimizer(state.optimizer, saved["optimizer"])
    state.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    if state.ema is not None:
        state.ema.load_state_dict(saved["ema"])
    if state.scaler is not None:
        state.scaler.load_state_dict(saved["scaler"])
    return state


def _laid_out(folder: Path) -> UNet2DConditionModel:
    """The checkpoint's U-Net on the meta device: shapes, no memory, to be restored into."""
    with torch.device("meta"):
        return UNet2DConditionModel.from_config(
            UNet2DConditionModel.load_config(folder / UNET_FOLDER)
        )


def restore_optimizer(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """The optimizer's saved state, each parameter's in the parameter's own memory layout:
    a checkpoint gives it back contiguous, beside channels_last weights, which takes AdamW
    off its fused and foreach paths (they need matching strides)."""
    optimizer.load_state_dict(saved)
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            for name, value in optimizer.state.get(parameter, {}).items():
                if (
                    torch.is_tensor(value)
                    and value.shape == parameter.shape
                    and value.stride() != parameter.stride()
                ):
                    like = torch.empty_like(parameter, dtype=value.dtype)
                    optimizer.state[parameter][name] = like.copy_(value)


def export_model(
    unet_config: dict, weights: dict[str, torch.Tensor], base: Path, folder: Path
) -> None:
    """A whole diffusers pipeline in `folder`: the base model's files with this U-Net in
    place of the base's."""
    shutil.copytree(
        base, folder, ignore=shutil.ignore_patterns(UNET_FOLDER, ".*"), dirs_exist_ok=True
    )
    save_unet(unet_config, weights, folder / UNET_FOLDER)


# The base models' files being fetched for the checkpoints that export a model: one at a
# time, on a thread started with the first.
_fetcher = ThreadPoolExecutor(1, thread_name_prefix="sdq-base")
_bases: dict[tuple[str, str], Future[Path]] = {}


def fetch_base_ahead(spec: TrainShardSpec, files: ModelFiles) -> None:
    """Starts fetching the base model's files now: the run's last checkpoint copies them
    beside its U-Net, and would otherwise fetch them (SD 2's VAE and text encoder: 1.7 GB)
    or build them while the run waits for it to finish."""
    key = (spec.base_source, spec.base_revision)
    if key not in _bases:
        _bases[key] = _fetcher.submit(base_folder, spec, files, files.cache_dir)


def fetched_base(spec: TrainShardSpec, files: ModelFiles) -> Path:
    """The base model's files, as fetch_base_ahead has them (or fetched now); a fetch that
    failed ahead is tried again, here, to fail with its own error."""
    fetch_base_ahead(spec, files)
    key = (spec.base_source, spec.base_revision)
    try:
        return _bases[key].result()
    except Exception:
        del _bases[key]
        return base_folder(spec, files, files.cache_dir)


def base_folder(spec: TrainShardSpec, files: ModelFiles, cache_dir: Path) -> Path:
    """The base model's files on local disk, to copy beside the trained U-Net."""
    if spec.base_source == tiny.TINY_NAME:
        folder = cache_dir / f"tiny-{spec.base_revision[:16]}"
        if not folder.is_dir():
            cache_dir.mkdir(parents=True, exist_ok=True)
            partial = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".tiny."))
            build_pipeline().save_pretrained(partial)
            try:
                partial.rename(folder)
            except OSError:  # another process saved it first; both are the same
                shutil.rmtree(partial, ignore_errors=True)
        return folder
    where = files.locate(spec.base_source, spec.base_revision)
    if where.revision is None:
        return Path(where.path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(where.path, revision=where.revision))


def training_flops_per_sample(state: TrainState, latents, embeddings) -> float:
    """The U-Net's FLOPs to train on one sample: its forward pass counted by torch's FLOP
    counter, times 3 for the backward pass (the usual model-FLOPs convention: recomputed
    activations do not count)."""
    from torch.utils.flop_counter import FlopCounterMode

    timesteps = torch.zeros((1,), dtype=torch.long, device=state.device)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        state.unet(latents[:1], timesteps, embeddings[:1])
    return 3.0 * counter.get_total_flops()
