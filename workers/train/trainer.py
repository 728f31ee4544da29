"""Fitting a U-Net on latents: the training state, one optimizer step, and checkpoints
that hold everything needed to go on exactly where they were written. GPU-side: imports
torch. The frozen VAE and text encoder are never loaded: the latent shards hold their
outputs.

On a GPU: bf16/fp16 autocast (fp16 with a gradient scaler), SDPA attention (diffusers'
default processor), optional gradient checkpointing and torch.compile, channels_last, and
the next batch copied from pinned memory while the current step runs. On a CPU the same
code runs in fp32.
"""

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel, compute_snr

from sdq.models import tiny
from sdq.models.registry import folder_content_hash
from sdq.models.training import TrainShardSpec
from sdq.workers.ahead import run_ahead
from sdq.workers.gpu import device_name
from sdq.workers.tiny import build_pipeline, build_unet
from sdq.workers.train.data import Batch
from sdq.workers.weights import ModelFiles, check_tiny_revision

AUTOCAST = {"fp16": torch.float16, "bf16": torch.bfloat16}
STATE_FILE = "training.pt"


@dataclass
class TrainState:
    run: int
    step: int
    unet: UNet2DConditionModel
    model: torch.nn.Module  # the unet, compiled when asked: what the steps call
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    ema: EMAModel | None
    scaler: torch.amp.GradScaler | None
    # Draws every step's noise and timesteps: saved, so a resumed run draws the same.
    generator: torch.Generator
    noise_scheduler: DDPMScheduler
    device: torch.device


def base_unet(spec: TrainShardSpec, files: ModelFiles) -> UNet2DConditionModel:
    if spec.base_source == tiny.TINY_NAME:
        check_tiny_revision(spec.base_revision)
        return build_unet()
    where = files.locate(spec.base_source, spec.base_revision)
    return UNet2DConditionModel.from_pretrained(
        where.path, subfolder="unet", revision=where.revision
    )


def new_state(spec: TrainShardSpec, unet: UNet2DConditionModel) -> TrainState:
    """The state before step 1, around the base model's U-Net."""
    options = spec.options
    device = torch.device(device_name())
    unet = _without_origin(unet).to(device, torch.float32).train()
    if device.type == "cuda":
        unet = unet.to(memory_format=torch.channels_last)
    if options.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=options.lr)
    ema = None
    if options.ema is not None:
        ema = EMAModel(
            unet.parameters(),
            decay=options.ema,
            model_cls=UNet2DConditionModel,
            model_config=unet.config,
        )
    return TrainState(
        run=spec.run,
        step=0,
        unet=unet,
        model=torch.compile(unet) if options.compile else unet,
        optimizer=optimizer,
        lr_scheduler=get_scheduler(
            "constant_with_warmup", optimizer, num_warmup_steps=options.lr_warmup
        ),
        ema=ema,
        scaler=torch.amp.GradScaler(device.type) if options.mixed_precision == "fp16" else None,
        generator=torch.Generator("cpu").manual_seed(options.seed),
        noise_scheduler=DDPMScheduler.from_config(
            {**spec.scheduler_config, "prediction_type": spec.prediction_type}
        ),
        device=device,
    )


def _without_origin(unet: UNet2DConditionModel) -> UNet2DConditionModel:
    """The U-Net with a config that does not name the folder it was loaded from: saved, that
    path would make two checkpoints of equal weights hash apart."""
    if "_name_or_path" not in unet.config:
        return unet
    config = {key: value for key, value in unet.config.items() if key != "_name_or_path"}
    clean = UNet2DConditionModel.from_config(config)
    clean.load_state_dict(unet.state_dict())
    return clean


def on_device(batches: Iterator[Batch], device: torch.device) -> Iterator[tuple]:
    """Batches as device tensors; on a GPU each is copied from pinned memory on a thread
    while the step before runs."""
    pin = device.type == "cuda"

    def moved(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        tensors = [torch.from_numpy(batch.latents), torch.from_numpy(batch.text_embeddings)]
        if pin:
            tensors = [tensor.pin_memory() for tensor in tensors]
        return tuple(tensor.to(device, non_blocking=pin) for tensor in tensors)

    return run_ahead((moved(batch) for batch in batches), depth=2)


def train_step(state: TrainState, spec: TrainShardSpec, latents, embeddings) -> float:
    """One optimizer step; returns its loss."""
    options, scheduler = spec.options, state.noise_scheduler
    size = latents.shape[0]
    # Drawn on the CPU generator: the same numbers on any device, and saved with the state.
    noise = torch.randn(latents.shape, generator=state.generator).to(state.device)
    timesteps = torch.randint(
        0, scheduler.config.num_train_timesteps, (size,), generator=state.generator
    ).to(state.device)
    noisy = scheduler.add_noise(latents, noise, timesteps)
    if spec.prediction_type == "v_prediction":
        target = scheduler.get_velocity(latents, noise, timesteps)
    else:
        target = noise
    precision = AUTOCAST.get(options.mixed_precision)
    with torch.autocast(state.device.type, dtype=precision, enabled=precision is not None):
        prediction = state.model(noisy, timesteps, embeddings).sample
    loss = _loss(prediction.float(), target.float(), timesteps, spec, scheduler)
    state.optimizer.zero_grad(set_to_none=True)
    if state.scaler is not None:
        state.scaler.scale(loss).backward()
        state.scaler.step(state.optimizer)
        state.scaler.update()
    else:
        loss.backward()
        state.optimizer.step()
    state.lr_scheduler.step()
    if state.ema is not None:
        state.ema.step(state.unet.parameters())
    state.step += 1
    return loss.item()


def _loss(prediction, target, timesteps, spec: TrainShardSpec, scheduler) -> torch.Tensor:
    """MSE, or with min-SNR weighting (Hang et al. 2023) as diffusers' scripts do it."""
    if spec.options.min_snr is None:
        return F.mse_loss(prediction, target)
    snr = compute_snr(scheduler, timesteps)
    weights = torch.clamp(snr, max=spec.options.min_snr)
    weights = weights / (snr + 1) if spec.prediction_type == "v_prediction" else weights / snr
    per_sample = F.mse_loss(prediction, target, reduction="none").mean(dim=[1, 2, 3])
    return (per_sample * weights).mean()


def save_checkpoint(state: TrainState, folder: Path) -> None:
    """The U-Net as diffusers saves it, and the rest of the state beside it."""
    state.unet.save_pretrained(folder / "unet")
    torch.save(
        {
            "step": state.step,
            "optimizer": state.optimizer.state_dict(),
            "lr_scheduler": state.lr_scheduler.state_dict(),
            "ema": state.ema.state_dict() if state.ema is not None else None,
            "scaler": state.scaler.state_dict() if state.scaler is not None else None,
            "generator": state.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
        },
        folder / STATE_FILE,
    )


def load_checkpoint(spec: TrainShardSpec, folder: Path) -> TrainState:
    """The state a checkpoint folder holds, as it was when written."""
    state = new_state(spec, UNet2DConditionModel.from_pretrained(folder / "unet"))
    saved = torch.load(folder / STATE_FILE, weights_only=False)
    state.step = saved["step"]
    state.optimizer.load_state_dict(saved["optimizer"])
    state.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    if state.ema is not None:
        state.ema.load_state_dict(saved["ema"])
    if state.scaler is not None:
        state.scaler.load_state_dict(saved["scaler"])
    state.generator.set_state(saved["generator"])
    torch.set_rng_state(saved["torch_rng"])
    return state


def export_model(state: TrainState, base: Path, folder: Path) -> str:
    """A whole diffusers pipeline in `folder`: the base model's files with this U-Net (its
    EMA weights, when kept) in place of the base's. Returns its content hash."""
    shutil.copytree(base, folder, ignore=shutil.ignore_patterns("unet", ".*"))
    if state.ema is None:
        state.unet.save_pretrained(folder / "unet")
    else:
        weights = UNet2DConditionModel.from_config(state.unet.config)
        state.ema.copy_to(weights.parameters())
        weights.save_pretrained(folder / "unet")
    return folder_content_hash(folder)


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
