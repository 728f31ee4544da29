"""A rank's training state: built around a U-Net (the base model's, or a new one drawn from
the run's seed), or restored from a checkpoint in the store (once per node: the first local
rank downloads it, the others read the same files); placed on the device, wrapped in
DistributedDataParallel over several unsharded ranks (or sharded: sharding.py), compiled if
asked, with its AdamW, learning-rate schedule and EMA. GPU-side: imports torch. The frozen
VAE and text encoder are never loaded: the latent shards hold their outputs.

On a GPU: bf16 autocast unless the run asks for fp16 (with a gradient scaler) or none, TF32
for what runs in fp32, cuDNN's autotuner, SDPA attention (diffusers' default processor),
fused AdamW, optional gradient checkpointing and torch.compile by region (compiled.py),
channels_last. On a CPU the
same code runs in fp32.
"""

import fcntl
import hashlib
import io
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from diffusers import DDPMScheduler, UNet2DConditionModel
from diffusers.configuration_utils import FrozenDict
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from safetensors.torch import load_file
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from sdq.models import tiny
from sdq.models.datasets import empty_pooled_key
from sdq.models.store import ObjectStore
from sdq.models.train.architectures import pooled_width
from sdq.models.train.specs import TrainOptions, TrainShardSpec, checkpoint_prefix
from sdq.workers.tiny import build_unet
from sdq.workers.train.loop.checkpoints import fetch_base_ahead
from sdq.workers.train.loop.compiled import SharedCompile, compile_regions
from sdq.workers.train.loop.files import ADAPTER_FILE, UNET_FOLDER, load_state
from sdq.workers.train.loop.lora import add_lora, load_adapter
from sdq.workers.train.loop.sharding import (
    SHARDED_FOLDER,
    is_sharded,
    restore,
    shard,
    state_group,
    unet_weights,
)
from sdq.workers.train.loop.state import ALONE, Ranks, TrainState
from sdq.workers.train.loop.step import autocast_dtype
from sdq.workers.weights import ModelFiles, check_tiny_revision

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
    # 1. The U-Net on this rank's device: whole, or sharded over the ranks (and a LoRA's).
    sharded = options.sharded and ranks.distributed
    unet = _on_device(unet, options, device, sharded=sharded)
    trained = [parameter for parameter in unet.parameters() if parameter.requires_grad]
    # 2. What trains it: AdamW (fused: one kernel for every parameter's update, on a GPU
    # and on the CPU, where its default loops over the parameters), the EMA.
    optimizer = torch.optim.AdamW(trained, lr=options.lr, fused=True)
    ema = _ema(trained, unet, options.ema, keeps=ranks.writes or sharded)
    # 3. What the steps call: the U-Net, its blocks compiled if asked, in DDP's wrapper over
    # several unsharded ranks.
    if options.compile:
        compile_regions(unet, buckets=options.buckets)
    model = unet if sharded or not ranks.distributed else _data_parallel(unet, options, device)
    return TrainState(
        run=spec.run,
        step=0,
        unet=unet,
        model=model,
        optimizer=optimizer,
        lr_scheduler=_lr_schedule(optimizer, options),
        ema=ema,
        scaler=torch.amp.GradScaler(device.type) if options.mixed_precision == "fp16" else None,
        noise_scheduler=DDPMScheduler.from_config(
            {**spec.scheduler_config, "prediction_type": spec.prediction_type}
        ),
        device=device,
        ranks=ranks,
        checkpoint_group=state_group() if sharded else None,
        lora=options.lora,
    )


def _lr_schedule(optimizer: torch.optim.Optimizer, options: TrainOptions):
    """--lr-schedule after --lr-warmup steps, over the run's steps."""
    return get_scheduler(
        LR_SCHEDULERS[options.lr_schedule],
        optimizer,
        num_warmup_steps=options.lr_warmup,
        num_training_steps=options.steps,
    )


def _on_device(
    unet: UNet2DConditionModel, options: TrainOptions, device: torch.device, *, sharded: bool
) -> UNet2DConditionModel:
    """The U-Net on this rank's device, whole or `sharded` over the ranks, with gradient
    checkpointing if asked, and a LoRA's adapters over it; one laid out on the meta device
    is given memory for its part."""
    unet = _placed(_without_origin(unet), device, channels_last=not options.sharded)
    if options.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    if sharded:
        shard(unet, options.sharding, options.grad_comm, device)
    if unet.device.type == "meta":
        unet.to_empty(device=device)
    if options.lora:
        add_lora(unet, options, autocast_dtype(options.mixed_precision, device))
    return unet


def _ema(
    trained: list[torch.nn.Parameter], unet: UNet2DConditionModel, decay: float | None, keeps: bool
) -> EMAModel | None:
    """EMA weights of the trained parameters, where the run keeps them (`decay`) and this
    rank does (its shards, when sharded: every rank keeps its own; else rank 0 keeps them
    all), updated with foreach ops."""
    if decay is None or not keeps:
        return None
    return LerpEMA(
        trained,
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


def restore_state(
    spec: TrainShardSpec,
    store: ObjectStore,
    files: ModelFiles,
    ranks: Ranks,
    node_folder: Path | None = None,
) -> TrainState:
    """The state the job starts from: the run's first (the base's U-Net, a new one, or the
    weights of the checkpoint the run goes on from), or its checkpoint at the first step.
    Ranks that share a `node_folder` (one node's) download a checkpoint once between them."""
    if spec.first_step == 0:
        state = new_state(spec, _first_unet(spec, store, files, node_folder), ranks)
    else:
        prefix = f"{checkpoint_prefix(spec.run, spec.first_step)}/state/"
        with downloaded(store, prefix, node_folder) as folder:
            state = load_checkpoint(spec, folder, ranks, files)
    if spec.options.caption_dropout:
        state.empty_prompt = empty_prompt(store, spec.empty_prompt_key).to(state.device)
        if pooled_width(state.unet.config) is not None:  # SDXL's
            pooled = empty_prompt(store, empty_pooled_key(spec.empty_prompt_key))
            state.empty_pooled = pooled.to(state.device)
    if spec.options.compile:
        state.compiled = SharedCompile(store)
    if ranks.writes and not spec.options.lora:  # a LoRA's model is its adapters alone
        fetch_base_ahead(spec, files)  # after the restore: it may have fetched them already
    return state


def _first_unet(
    spec: TrainShardSpec, store: ObjectStore, files: ModelFiles, node_folder: Path | None
):
    if spec.start_from is None:
        return base_unet(spec, files)
    state = f"{spec.start_from}/state/"
    if next(store.list_keys(f"{state}{SHARDED_FOLDER}/"), None) is None:
        with downloaded(store, f"{state}unet/", node_folder) as folder:
            return UNet2DConditionModel.from_pretrained(folder)
    # Written by a sharded run, at whatever world size: each rank reads the whole U-Net.
    with downloaded(store, state, node_folder) as folder:
        return unet_weights(folder)


@contextmanager
def downloaded(store: ObjectStore, prefix: str, node_folder: Path | None) -> Iterator[Path]:
    """The objects under a prefix, in a local folder while the block runs; in
    `node_folder`, shared with the node's other ranks, who find it there (the first to
    come downloads it, the others wait for it on a lock)."""
    if node_folder is None:
        with tempfile.TemporaryDirectory(prefix="sdq-checkpoint-") as folder:
            _download(store, prefix, Path(folder))
            yield Path(folder)
        return
    restores = node_folder / "restores"
    restores.mkdir(exist_ok=True)
    folder = restores / hashlib.sha256(prefix.encode()).hexdigest()[:16]
    with (restores / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / DOWNLOADED).is_file():
            # The node's earlier restores: every rank has gone past them, to this one.
            for older in restores.iterdir():
                if older.is_dir():
                    shutil.rmtree(older)
            _download(store, prefix, folder)
            (folder / DOWNLOADED).touch()
    yield folder


# Marks a node's shared download complete.
DOWNLOADED = ".downloaded"


def _download(store: ObjectStore, prefix: str, folder: Path) -> None:
    for key in store.list_keys(prefix):
        store.get_file(key, folder / key.removeprefix(prefix))


def empty_prompt(store: ObjectStore, key: str | None) -> torch.Tensor:
    """The text encoder's output for "" (tokens x hidden size; or beside it, SDXL's pooled
    embedding), as the encode run stored it."""
    if key is None:
        raise ValueError("caption dropout needs the empty prompt's embedding; the spec has none")
    return torch.from_numpy(np.load(io.BytesIO(store.get_bytes(key))).astype(np.float32))


def load_checkpoint(
    spec: TrainShardSpec, folder: Path, ranks: Ranks = ALONE, files: ModelFiles | None = None
) -> TrainState:
    """The state a checkpoint folder holds, as it was when written (a LoRA's adapters over
    its base's U-Net, which `files` finds)."""
    if is_sharded(folder):
        state = new_state(spec, _laid_out(folder), ranks)
        restore(state, folder)
        return state
    if spec.options.lora:
        state = new_state(spec, base_unet(spec, files), ranks)
        load_adapter(state.unet, load_file(folder / ADAPTER_FILE, device=str(state.device)))
    else:
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
