"""A run's checkpoints: the state copied to host memory at a step (a snapshot), written to
the object store from that copy on a thread while the training goes on (the devices wait
for the copy, not for the upload), with the whole pipeline beside it when the checkpoint is
a model (the base model's VAE and text encoder, fetched from the run's first job on, around
the trained U-Net). Every checkpoint holds everything needed to go on exactly where it was
written (build.py restores it). GPU-side: imports torch.
"""

import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from time import perf_counter
from typing import Any, TypeVar

import torch
from safetensors.torch import save_file

from sdq.models import tiny
from sdq.models.registry import content_hash, file_sha256, folder_content_hash
from sdq.models.store import ObjectStore
from sdq.models.train.specs import TrainShardSpec, checkpoint_prefix
from sdq.workers.tiny import build_pipeline
from sdq.workers.train.loop.files import ADAPTER_FILE, UNET_FOLDER, save_state, save_unet
from sdq.workers.train.loop.lora import adapter_weights, save_lora_file
from sdq.workers.train.loop.sharding import ShardedSnapshot, every_rank_hashes, shard_hashes
from sdq.workers.train.loop.state import TrainState
from sdq.workers.train.records import Written
from sdq.workers.weights import ModelFiles


@dataclass(frozen=True)
class Snapshot:
    """The training state at one step, copied to host memory: what a checkpoint writes, from
    a thread, while the training goes on from the same state on the device."""

    step: int
    unet_config: dict
    # The U-Net's state dict; a LoRA run's adapter weights (`lora`), its U-Net being its base's.
    unet: dict[str, torch.Tensor]
    # The optimizer's, learning rate scheduler's, EMA's and gradient scaler's state dicts.
    training: dict[str, Any]
    # The U-Net's state dict with the EMA's weights (the same tensors as its state dict's).
    ema_unet: dict[str, torch.Tensor] | None
    seconds: float  # how long the training waited for the copy
    lora: bool = False

    @property
    def model_weights(self) -> dict[str, torch.Tensor]:
        """The U-Net's weights a model made from this checkpoint has: the EMA's, when kept."""
        return self.unet if self.ema_unet is None else self.ema_unet


def snapshot(state: TrainState) -> Snapshot:
    """The state's copy on the host, into pinned memory from a GPU (one wait for all the
    copies), contiguous as safetensors writes it."""
    started = perf_counter()
    weights = adapter_weights(state.unet) if state.lora else state.unet.state_dict()
    unet = _host_copies(weights, state.device)
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
        # One shadow per trained parameter, in the U-Net's parameter order (the adapter's
        # weights are all parameters, in that order).
        names = list(unet) if state.lora else [name for name, _ in state.unet.named_parameters()]
        shadows = training["ema"]["shadow_params"]
        ema_unet = {**unet, **dict(zip(names, shadows, strict=True))}
    return Snapshot(
        state.step,
        dict(state.unet.config),
        unet,
        training,
        ema_unet,
        seconds=perf_counter() - started,
        lora=state.lora,
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
    writes the same bytes, and any world size can go on from it. A LoRA run's holds its
    adapter in place of the U-Net."""
    if snapshot.lora:
        folder.mkdir(parents=True, exist_ok=True)
        save_file(snapshot.unet, folder / ADAPTER_FILE)
    else:
        save_unet(snapshot.unet_config, snapshot.unet, folder / UNET_FOLDER)
    save_state({"step": snapshot.step, **snapshot.training}, folder)


T = TypeVar("T")


# Objects a checkpoint puts in the store at once.
UPLOAD_THREADS = 8


def write_checkpoint(
    spec: TrainShardSpec, snapshot: Snapshot | ShardedSnapshot, store: ObjectStore,
    files: ModelFiles,
) -> Written | None:  # fmt: skip
    """The training state in the store, and the whole pipeline beside it when this
    checkpoint is a model; what rank 0 records of it (None on the other ranks of a sharded
    run, which write their own parts)."""
    if isinstance(snapshot, ShardedSnapshot):
        return _write_sharded(spec, snapshot, store, files)
    prefix = checkpoint_prefix(spec.run, snapshot.step)
    # The model (when the checkpoint is one) is written beside the state, on a thread.
    with ThreadPoolExecutor(1, thread_name_prefix="sdq-model") as beside:
        model = beside.submit(_write_model, spec, snapshot, store, files)
        with tempfile.TemporaryDirectory(prefix="sdq-checkpoint-") as temporary:
            folder = Path(temporary)
            save_checkpoint(snapshot, folder / "state")
            state_sha256 = _upload(store, prefix, folder, sorted(folder.rglob("*")),
                                   lambda: folder_content_hash(folder / "state"))  # fmt: skip
        model_prefix, revision = model.result()
    # The training waited for the snapshot only: the rest overlaps the next steps.
    return Written(snapshot.step, store.uri(prefix), state_sha256, model_prefix, revision,
                   snapshot.seconds)  # fmt: skip


def _write_sharded(
    spec: TrainShardSpec, snapshot: ShardedSnapshot, store: ObjectStore, files: ModelFiles
) -> Written | None:
    """This rank's part in the store; on rank 0, once every rank's is there, the whole
    checkpoint's hash (of every part's) and its model."""
    prefix = checkpoint_prefix(spec.run, snapshot.step)
    try:
        own = _upload(store, f"{prefix}/state", snapshot.folder, snapshot.files(),
                      lambda: shard_hashes(snapshot))  # fmt: skip
        hashes = every_rank_hashes(snapshot, own)
        if snapshot.rank != 0:
            return None
        model_prefix, revision = _write_model(spec, snapshot, store, files)
    finally:
        snapshot.close()
    return Written(snapshot.step, store.uri(prefix), content_hash(sorted(hashes.items())),
                   model_prefix, revision, snapshot.seconds)  # fmt: skip


def _write_model(
    spec: TrainShardSpec, snapshot: Snapshot | ShardedSnapshot, store: ObjectStore,
    files: ModelFiles,
) -> tuple[str | None, str | None]:  # fmt: skip
    """The model in the store when the checkpoint is one (at the step the job reached,
    which is its last unless it stopped early): its prefix and content hash. A model is a
    whole pipeline, or a LoRA run's one LoRA file (hashed as a file: what `--lora` names)."""
    if not replace(spec, last_step=snapshot.step).exports_model:
        return None, None
    prefix = f"{checkpoint_prefix(spec.run, snapshot.step)}/model"
    with tempfile.TemporaryDirectory(prefix="sdq-model-") as temporary:
        folder = Path(temporary)
        if spec.options.lora:
            path = save_lora_file(snapshot.model_weights, spec.options, folder)
            revision = _upload(store, prefix, folder, [path], lambda: file_sha256(path))
        else:
            export_model(snapshot.unet_config, snapshot.model_weights, fetched_base(spec, files),
                         folder)  # fmt: skip
            revision = _upload(store, prefix, folder, sorted(folder.rglob("*")),
                               lambda: folder_content_hash(folder))  # fmt: skip
    return prefix, revision


def _upload(
    store: ObjectStore, prefix: str, folder: Path, paths: list[Path], hashing: Callable[[], T]
) -> T:
    """The files put at once (a checkpoint is a dozen objects or more, each a round trip,
    and the last one's write is on the run's clock), and what `hashing` returns, hashed on
    a thread meanwhile: both read the files from the page cache, and hashing SD 2's state
    (12.9 GB) takes seconds that would otherwise add to the upload's."""
    with ThreadPoolExecutor(UPLOAD_THREADS + 1, thread_name_prefix="sdq-upload") as uploads:
        hashed = uploads.submit(hashing)
        for put in [
            uploads.submit(store.put_file, f"{prefix}/{path.relative_to(folder).as_posix()}", path)
            for path in paths
            if path.is_file()
        ]:
            put.result()
        return hashed.result()


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
