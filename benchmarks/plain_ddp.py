"""The plain way to train a U-Net on precomputed latents, as diffusers' train_text_to_image.py
does it, under torchrun: the latent shards on local disk loaded into a torch Dataset, a
DataLoader with a DistributedSampler, DDP, AdamW, DDPM noise, min-SNR weighted MSE, EMA
weights. No queue, no database, no object store, no checkpoints, and nothing of sdq's: what
sdq is measured against by benchmarks/train.py and benchmarks/train_scaling.py. With
--lora-rank, diffusers' train_text_to_image_lora.py instead: the U-Net frozen (in the
autocast precision), peft LoRA adapters on its attention trained in fp32, no EMA.

    torchrun --nproc-per-node N benchmarks/plain_ddp.py --shards DIR \\
        (--unet-config FILE | --unet-pretrained DIR) --scheduler-config FILE --steps S \\
        --batch-size B [--lora-rank R] [--timed-from K] [--compile]
"""

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DConditionModel
from diffusers.training_utils import EMAModel, cast_training_params, compute_snr
from peft import LoraConfig
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def column(table: pa.Table, name: str) -> np.ndarray:
    """A tensor column in its shape, from the shapes the file's metadata gives."""
    about = json.loads(table.schema.metadata[b"sdq"])["tensors"][name]
    shape, dtype = (len(table), *about["shape"]), np.dtype(about["dtype"])
    chunk = table.column(name).combine_chunks()
    if pa.types.is_fixed_size_binary(chunk.type):
        raw = np.frombuffer(chunk.buffers()[1], np.uint8)
        start = chunk.offset * chunk.type.byte_width
        return raw[start : start + len(table) * chunk.type.byte_width].view(dtype).reshape(shape)
    return chunk.values.to_numpy(zero_copy_only=False).astype(dtype).reshape(shape)


def latent_dataset(folder: Path) -> TensorDataset:
    latents, embeddings = [], []
    for path in sorted(folder.rglob("*.parquet")):
        table = pq.read_table(path, columns=["latents", "text_embeddings"])
        latents.append(column(table, "latents"))
        embeddings.append(column(table, "text_embeddings"))
    return TensorDataset(
        torch.from_numpy(np.concatenate(latents)), torch.from_numpy(np.concatenate(embeddings))
    )


def loss_of(unet, scheduler, latents, embeddings, snr_gamma: float) -> torch.Tensor:
    noise = torch.randn_like(latents)
    timesteps = torch.randint(
        0, scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device
    )
    noisy = scheduler.add_noise(latents, noise, timesteps)
    prediction = unet(noisy, timesteps, embeddings).sample
    snr = compute_snr(scheduler, timesteps)
    weights = torch.stack([snr, snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0] / snr
    loss = F.mse_loss(prediction.float(), noise.float(), reduction="none")
    return (loss.mean(dim=list(range(1, loss.ndim))) * weights).mean()


def timer(cuda: bool) -> float:
    """The time once the device has finished what it was given."""
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def compiled_graphs() -> int:
    """The graphs torch.compile has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def unet_of(args, precision: torch.dtype | None) -> UNet2DConditionModel:
    """A U-Net from its config (weights from the seed) or a pipeline's U-Net folder; with
    --lora-rank, frozen under LoRA adapters as train_text_to_image_lora.py makes it."""
    if args.unet_pretrained is not None:
        unet = UNet2DConditionModel.from_pretrained(args.unet_pretrained)
    else:
        unet = UNet2DConditionModel.from_config(json.loads(args.unet_config.read_text()))
    if args.lora_rank:
        unet.requires_grad_(False)
        if precision is not None:
            unet.to(precision)
        unet.add_adapter(
            LoraConfig(r=args.lora_rank, lora_alpha=args.lora_rank, init_lora_weights="gaussian",
                       target_modules=["to_k", "to_q", "to_v", "to_out.0"])
        )  # fmt: skip
        cast_training_params(unet, dtype=torch.float32)
    return unet


def main(args) -> None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=10))
    torch.manual_seed(args.seed)
    precision = torch.bfloat16 if cuda else None
    unet = unet_of(args, precision).to(device).train()
    trained = [parameter for parameter in unet.parameters() if parameter.requires_grad]
    scheduler = DDPMScheduler.from_config(json.loads(args.scheduler_config.read_text()))
    optimizer = torch.optim.AdamW(trained, lr=args.lr)
    ema = None if args.lora_rank else EMAModel(trained, decay=args.ema)
    model = DistributedDataParallel(unet, device_ids=[device.index] if cuda else None)
    if args.compile:
        model = torch.compile(model, backend=args.compile_backend)
    dataset = latent_dataset(args.shards)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size // world_size, sampler=sampler,
                        drop_last=True, pin_memory=cuda)  # fmt: skip
    step, epoch, started, graphs = 0, 0, None, None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    loop_started = timer(cuda)
    while step < args.steps:
        sampler.set_epoch(epoch)
        for latents, embeddings in loader:
            latents = latents.to(device, non_blocking=True).float()
            embeddings = embeddings.to(device, non_blocking=True).float()
            with torch.autocast(device.type, dtype=precision, enabled=precision is not None):
                loss = loss_of(model, scheduler, latents, embeddings, args.snr_gamma)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if ema is not None:
                ema.step(trained)
            step += 1
            if step == 1:  # compiled, the first step compiles
                first_step = timer(cuda) - loop_started
            if step == args.timed_from:
                started = timer(cuda)
                graphs = compiled_graphs() if args.compile else None
            if step == args.steps:
                break
        epoch += 1
    ended = timer(cuda)
    dist.barrier()
    if rank == 0:
        timed = {}
        if started is not None:
            samples = (step - args.timed_from) * args.batch_size
            timed["samples_per_second"] = samples / (ended - started)
        if cuda:
            timed["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        if graphs is not None:
            timed["recompiles_after_warm"] = compiled_graphs() - graphs
        print(json.dumps({"steps": step, "last_loss": loss.item(), "first_step_s": first_step,
                          **timed}))  # fmt: skip
    # Freeing DDP's reducer at exit can deadlock with gloo's worker thread; nothing is left
    # to clean up.
    os._exit(0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=Path, required=True)
    unet = parser.add_mutually_exclusive_group(required=True)
    unet.add_argument("--unet-config", type=Path)
    unet.add_argument("--unet-pretrained", type=Path, help="a pipeline's unet folder")
    parser.add_argument("--lora-rank", type=int, help="train a LoRA of this rank on it")
    parser.add_argument("--scheduler-config", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--ema", type=float, default=0.9999)
    parser.add_argument("--snr-gamma", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timed-from", type=int, help="also print samples/s after this step")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--compile-backend", default="inductor")
    main(parser.parse_args())
