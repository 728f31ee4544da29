"""A rank's training state, built around a U-Net: the base model's, or a new one drawn from
the run's seed; placed on the device, wrapped in DistributedDataParallel over several
unsharded ranks (or sharded: sharding.py), compiled if asked, with its AdamW, learning-rate
schedule and EMA. And the base model's files, which a checkpoint that is a model copies
beside its U-Net. GPU-side: imports torch. The frozen VAE and text encoder are never
loaded: the latent shards hold their outputs.

On a GPU: bf16 autocast unless the run asks for fp16 (with a gradient scaler) or none, TF32
for what runs in fp32, cuDNN's autotuner, SDPA attention (diffusers' default processor),
fused AdamW, optional gradient checkpointing and torch.compile, channels_last. On a CPU the
same code runs in fp32.
"""

import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers import DDPMScheduler, UNet2DConditionModel
from diffusers.configuration_utils import FrozenDict
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from sdq.models import tiny
from sdq.models.train.specs import TrainOptions, TrainShardSpec
from sdq.workers.tiny import build_pipeline, build_unet
from sdq.workers.train.loop.files import UNET_FOLDER, save_unet
from sdq.workers.train.loop.sharding import shard, state_group
from sdq.workers.train.loop.state import ALONE, Ranks, TrainState
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
    sharded = options.sharded and ranks.distributed
    unet = _on_device(unet, options, device, sharded=sharded)
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


def _on_device(
    unet: UNet2DConditionModel, options: TrainOptions, device: torch.device, *, sharded: bool
) -> UNet2DConditionModel:
    """The U-Net on this rank's device, whole or `sharded` over the ranks, with gradient
    checkpointing if asked; one laid out on the meta device is given memory for its part."""
    unet = _placed(_without_origin(unet), device, channels_last=not options.sharded)
    if options.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    if sharded:
        shard(unet, options.sharding, options.grad_comm, device)
    if unet.device.type == "meta":
        unet.to_empty(device=device)
    return unet


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
