"""The train step's options on the CPU path, checked against the arithmetic they stand for:
v-prediction with min-SNR weighting, LR warmup and schedules, EMA, bf16 autocast, gradient
checkpointing and accumulation, clipping, caption dropout, offset noise, per-sample draws
that do not depend on the world size, and U-Nets built from scratch."""

import copy
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import UNet2DConditionModel
from diffusers.training_utils import EMAModel

from sdq.models import tiny
from sdq.models.registry import tiny_identity
from sdq.models.train.architectures import UNET_ARCHITECTURES, InvalidArchitecture, check_fits
from sdq.models.train.specs import TrainOptions, TrainShardSpec
from sdq.workers.gpu import peak_flops, peak_flops_of
from sdq.workers.tiny import build_unet
from sdq.workers.train.loop.build import (
    LerpEMA,
    _data_parallel,
    base_unet,
    load_checkpoint,
    new_state,
    restore_optimizer,
    use_fast_kernels,
)
from sdq.workers.train.loop.checkpoints import save_checkpoint, snapshot
from sdq.workers.train.loop.diverged import Diverged, DivergenceWatch
from sdq.workers.train.loop.files import save_unet
from sdq.workers.train.loop.state import Ranks, TrainState
from sdq.workers.train.loop.step import (
    autocast_dtype,
    draw,
    step_inputs,
    train_step,
    training_flops_per_sample,
)

BATCH = 2


def spec(prediction_type: str = "epsilon", **options) -> TrainShardSpec:
    model = tiny_identity()
    return TrainShardSpec(
        run=0, first_step=0, last_step=3, model_name="test", base_name=model.name,
        base_source=model.source, base_revision=model.revision,
        prediction_type=prediction_type, scheduler_config=model.scheduler_config,
        options=TrainOptions(steps=3, batch_size=BATCH, **options),
    )  # fmt: skip


def step(state, shard: TrainShardSpec, latents, embeddings) -> float:
    """One train step on host tensors, its loss read back."""
    return train_step(state, shard, step_inputs(state, shard, latents, embeddings)).item()


def draws_of(state, shard: TrainShardSpec, sample_shape):
    """The draws of the state's next step, for its rank's samples."""
    part = state.ranks.part(shard.options.batch_size)
    return draw(shard, state.step + 1, part, sample_shape)


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    size = tiny.UNET_CONFIG["sample_size"]
    latents = torch.randn((BATCH, 4, size, size), generator=generator)
    embeddings = torch.randn(
        (BATCH, 7, tiny.UNET_CONFIG["cross_attention_dim"]), generator=generator
    )
    return latents, embeddings


def test_v_prediction_with_min_snr_is_the_weighted_velocity_error() -> None:
    shard = spec("v_prediction", min_snr=5.0, ema=None)
    state = new_state(shard, build_unet())
    before = copy.deepcopy(state.unet)
    latents, embeddings = batch(1)
    # The draws of step 1: a function of the seed, the step and the sample alone.
    draws = draws_of(state, shard, latents.shape[1:])
    noise, steps = draws.noise, draws.timesteps

    loss = step(state, shard, latents, embeddings)

    alphas = state.noise_scheduler.alphas_cumprod[steps]
    a, s = alphas.sqrt().view(-1, 1, 1, 1), (1 - alphas).sqrt().view(-1, 1, 1, 1)
    noisy, velocity = a * latents + s * noise, a * noise - s * latents
    snr = alphas / (1 - alphas)
    weights = torch.clamp(snr, max=5.0) / (snr + 1)
    with torch.no_grad():
        prediction = before(noisy, steps, embeddings).sample
    errors = F.mse_loss(prediction, velocity, reduction="none").mean(dim=[1, 2, 3])
    assert loss == pytest.approx((errors * weights).mean().item(), rel=1e-4)


def test_warmup_ema_bf16_and_gradient_checkpointing_train() -> None:
    shard = spec(lr=1e-3, lr_warmup=4, ema=0.5, mixed_precision="bf16", gradient_checkpointing=True)
    state = new_state(shard, build_unet())
    assert state.unet.is_gradient_checkpointing
    start = [p.detach().clone() for p in state.unet.parameters()]
    rates = []
    for seed in range(3):
        loss = step(state, shard, *batch(seed))
        assert torch.isfinite(torch.tensor(loss))
        rates.append(state.optimizer.param_groups[0]["lr"])
    assert rates == pytest.approx([1e-3 / 4, 2e-3 / 4, 3e-3 / 4])  # linear warmup
    moved = [p.detach() for p in state.unet.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(start, moved, strict=True))
    # The EMA weights trail the trained ones instead of copying them.
    shadow = state.ema.shadow_params
    assert any(not torch.equal(e, m) for e, m in zip(shadow, moved, strict=True))


def test_the_ema_follows_diffusers_ema_step_for_step() -> None:
    """sdq's EMA (one foreach lerp a step) keeps the weights diffusers' EMAModel keeps, the
    warm-up of its decay included, over parameters that move every step."""
    generator = torch.Generator().manual_seed(0)
    parameters = [torch.nn.Parameter(torch.randn(shape, generator=generator))
                  for shape in ((3, 4), (5,), (2, 2, 3, 3))]  # fmt: skip
    ours = LerpEMA(parameters, decay=0.99)
    theirs = EMAModel(parameters, decay=0.99, foreach=True)
    for _ in range(30):
        with torch.no_grad():
            for parameter in parameters:
                parameter.add_(torch.randn(parameter.shape, generator=generator))
        ours.step(parameters)
        theirs.step(parameters)
    assert ours.cur_decay_value == theirs.cur_decay_value == pytest.approx(30 / 39)
    for mine, reference, parameter in zip(ours.shadow_params, theirs.shadow_params, parameters,
                                          strict=True):  # fmt: skip
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(mine, parameter)  # it trails the weights


def trained(shard: TrainShardSpec, batches: list, unet) -> list[float]:
    state = new_state(shard, unet)
    return [step(state, shard, *pair) for pair in batches]


def test_accumulated_micro_batches_make_the_same_step_as_one_batch() -> None:
    latents, embeddings = batch(0)
    states = {}
    for accumulation in (1, 2):
        shard = spec(ema=None, grad_accumulation=accumulation)
        states[accumulation] = new_state(shard, build_unet())
        loss = step(states[accumulation], shard, latents, embeddings)
        states[accumulation].loss = loss
    assert states[2].loss == pytest.approx(states[1].loss, rel=1e-6)
    # The step's gradients (what the optimizer took) are the whole batch's.
    for whole, halves in zip(states[1].unet.parameters(), states[2].unet.parameters(), strict=True):
        torch.testing.assert_close(halves.grad, whole.grad, rtol=1e-3, atol=1e-6)


def test_gradients_are_clipped_to_the_max_norm() -> None:
    shard = spec(ema=None, max_grad_norm=0.01)
    state = new_state(shard, build_unet())
    step(state, shard, *batch(0))
    norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad) for p in state.unet.parameters()])
    )
    assert norm.item() == pytest.approx(0.01, rel=1e-3)
    unclipped = new_state(spec(ema=None), build_unet())
    step(unclipped, spec(ema=None), *batch(0))
    grads = [torch.linalg.vector_norm(p.grad) for p in unclipped.unet.parameters()]
    assert torch.linalg.vector_norm(torch.stack(grads)).item() > 0.1


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        # 2 warmup steps, then down to 0 at step 6 (the run's last).
        ("linear", [0.5, 1.0, 0.75, 0.5, 0.25, 0.0]),
        ("cosine", [0.5, 1.0, 0.8536, 0.5, 0.1464, 0.0]),
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
    ],
)
def test_learning_rate_schedules_after_warmup(schedule: str, expected: list[float]) -> None:
    shard = replace(
        spec(ema=None, lr=1.0, lr_warmup=2, lr_schedule=schedule),
        options=TrainOptions(steps=6, batch_size=BATCH, lr=1.0, lr_warmup=2, lr_schedule=schedule),
    )
    state = new_state(shard, build_unet())
    rates = []
    for _ in range(6):
        state.optimizer.step()
        state.lr_scheduler.step()
        rates.append(state.lr_scheduler.get_last_lr()[0])
    assert rates == pytest.approx(expected, abs=1e-4)


def test_caption_dropout_trains_dropped_samples_on_the_empty_prompt() -> None:
    shard = spec(ema=None, caption_dropout=0.5)
    state = new_state(shard, build_unet())
    state.empty_prompt = torch.randn((7, tiny.UNET_CONFIG["cross_attention_dim"]))
    latents, embeddings = batch(3)
    dropped = draws_of(state, shard, latents.shape[1:]).dropped
    # Seed 0's draws drop one sample of the two at step 1: both cases are exercised.
    assert dropped.tolist() == [False, True]
    replaced = torch.where(dropped[:, None, None], state.empty_prompt, embeddings)
    plain = new_state(spec(ema=None), build_unet())
    expected = _loss_of(plain, spec(ema=None), latents, replaced)
    assert step(state, shard, latents, embeddings) == pytest.approx(expected, rel=1e-5)


def _loss_of(state, shard, latents, embeddings) -> float:
    return step(state, shard, latents, embeddings)


def test_offset_noise_adds_one_constant_per_channel() -> None:
    latents, _ = batch(0)
    plain = draw(spec(), 1, slice(0, BATCH), latents.shape[1:]).noise
    offset = draw(spec(noise_offset=0.1), 1, slice(0, BATCH), latents.shape[1:]).noise
    difference = offset - plain
    per_channel = difference.mean(dim=(2, 3), keepdim=True)
    torch.testing.assert_close(difference, per_channel.expand_as(difference))
    assert 0 < per_channel.abs().max().item() < 0.5


def test_draws_are_the_same_for_a_sample_whatever_the_world_size() -> None:
    latents, _ = batch(0)
    one = draw(spec(), 1, slice(0, BATCH), latents.shape[1:])
    shard = spec()
    halves = []
    for rank in range(2):
        state = new_state(shard, build_unet())
        state.ranks = Ranks(rank=rank, world_size=2)
        halves.append(draws_of(state, shard, latents.shape[1:]))
    torch.testing.assert_close(torch.cat([half.noise for half in halves]), one.noise)
    assert torch.cat([half.timesteps for half in halves]).tolist() == one.timesteps.tolist()


def test_from_scratch_builds_the_named_architecture_from_the_seed() -> None:
    # SD 2's architecture at a tenth of its width, as a config file would give it.
    narrow = {
        **UNET_ARCHITECTURES["sd2-base"],
        "block_out_channels": [32, 64, 64, 64],
        "attention_head_dim": [2, 4, 4, 4],
        "cross_attention_dim": tiny.UNET_CONFIG["cross_attention_dim"],
        "sample_size": 8,
    }
    shard = spec(from_scratch=True, unet_config=narrow)
    first, second = base_unet(shard, files=None), base_unet(shard, files=None)
    assert list(first.config.block_out_channels) == [32, 64, 64, 64]
    assert first.config.use_linear_projection
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)  # the seed decides the weights
    other = base_unet(replace(shard, options=replace(shard.options, seed=1)), files=None)
    assert not torch.equal(next(first.parameters()), next(other.parameters()))
    # It trains on the tiny model's latents and text embeddings as they are.
    losses = trained(shard, [batch(0), batch(1)], unet=first)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_an_unfitting_architecture_is_refused_with_its_reason() -> None:
    with pytest.raises(InvalidArchitecture, match="1024-wide text embeddings; the dataset"):
        check_fits(UNET_ARCHITECTURES["sd2-base"], latent_channels=4, text_width=32, pooled=None)
    with pytest.raises(ValueError, match="--unet-config sets the architecture"):
        TrainOptions(steps=1, unet_config={"block_out_channels": [32]})
    with pytest.raises(ValueError, match="multiple of --world-size 3 x --grad-accumulation 2"):
        TrainOptions(steps=1, batch_size=8, world_size=3, grad_accumulation=2)


def test_model_flops_per_sample_scale_with_the_latent_size() -> None:
    shard = spec()
    state = new_state(shard, build_unet())
    latents, embeddings = batch(0)
    small = training_flops_per_sample(state, shard, latents, embeddings)
    large = training_flops_per_sample(state, shard,
                                      torch.cat([latents] * 2, dim=3).repeat(1, 1, 2, 1),
                                      embeddings)  # fmt: skip
    assert small > 0 and 3.5 < large / small < 4.5  # four times the pixels
    assert peak_flops(state.device) is None  # no MFU on a CPU


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H800", 989),
        ("NVIDIA H200", 989),
        ("NVIDIA GH200 480GB", 989),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA A100 80GB PCIe", 312),
        ("NVIDIA A800-SXM4-80GB", 312),
        ("NVIDIA A10G", 125),
        ("NVIDIA L40", 181),
        ("NVIDIA L40S", 362),
        ("NVIDIA L4", 121),
        ("Tesla V100-SXM2-16GB", 125),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_flops_are_matched_by_the_device_s_whole_name(name: str, tflops) -> None:
    assert peak_flops_of(name) == (tflops * 1e12 if tflops else None)


def test_a_loaded_u_net_is_trained_as_it_is_not_built_again(tmp_path) -> None:
    build_unet().save_pretrained(tmp_path / "unet")
    loaded = UNet2DConditionModel.from_pretrained(tmp_path / "unet")
    assert "_name_or_path" in loaded.config
    state = new_state(spec(), loaded)
    # The same module, its config no longer naming the folder (which checkpoints would keep).
    assert state.unet is loaded and "_name_or_path" not in state.unet.config


def test_restored_optimizer_state_takes_its_parameters_memory_layout() -> None:
    shard = spec(ema=None)
    trained_state = new_state(shard, build_unet())
    step(trained_state, shard, *batch(0))
    saved = copy.deepcopy(trained_state.optimizer.state_dict())
    # As on a GPU: the restored U-Net's weights are channels_last, the saved state is not.
    restored = new_state(shard, build_unet().to(memory_format=torch.channels_last))
    restore_optimizer(restored.optimizer, saved)
    moments = [
        (parameter, moment)
        for parameter in restored.unet.parameters()
        for name, moment in restored.optimizer.state[parameter].items()
        if name in ("exp_avg", "exp_avg_sq")
    ]
    four_d = [(p, m) for p, m in moments if p.dim() == 4]
    assert four_d and not all(p.is_contiguous() for p, _ in four_d)
    assert all(moment.stride() == parameter.stride() for parameter, moment in moments)
    step(restored, shard, *batch(1))  # and AdamW steps on them


def files_in(folder) -> dict:
    return {path.relative_to(folder): path.read_bytes()
            for path in sorted(folder.rglob("*")) if path.is_file()}  # fmt: skip


def test_a_checkpoint_s_u_net_is_the_folder_diffusers_writes(tmp_path) -> None:
    """Written from the snapshot's weights and config without building a U-Net, byte for
    byte what save_pretrained writes of the live one, so diffusers loads it as its own."""
    shard = spec(lr=1e-3)
    state = new_state(shard, build_unet())
    step(state, shard, *batch(0))
    taken = snapshot(state)
    save_unet(taken.unet_config, taken.unet, tmp_path / "sdq")
    state.unet.save_pretrained(tmp_path / "diffusers")
    assert files_in(tmp_path / "sdq") == files_in(tmp_path / "diffusers")
    loaded = UNet2DConditionModel.from_pretrained(tmp_path / "sdq").state_dict()
    assert all(torch.equal(loaded[name], weight) for name, weight in taken.unet.items())


def going_on_and_resumed(shard: TrainShardSpec, tmp_path) -> tuple[dict[str, dict], TrainState]:
    """Four steps, the checkpoint at step 2 written from its snapshot after the training
    went on from it (as it does while a checkpoint uploads), the state resumed from that
    checkpoint taking steps 3 and 4 too: each one's checkpoint files at step 4 (by
    "going-on" and "resumed"), and the resumed state."""
    going_on = new_state(shard, build_unet())
    for seed in (0, 1):
        step(going_on, shard, *batch(seed))
    at_two = snapshot(going_on)
    step(going_on, shard, *batch(2))
    save_checkpoint(at_two, tmp_path / "at-2")
    resumed = load_checkpoint(shard, tmp_path / "at-2")
    assert resumed.step == 2
    step(resumed, shard, *batch(2))
    for state, folder in ((going_on, "going-on"), (resumed, "resumed")):
        step(state, shard, *batch(3))
        save_checkpoint(snapshot(state), tmp_path / folder)
    return {folder: files_in(tmp_path / folder) for folder in ("going-on", "resumed")}, resumed


def test_a_state_resumed_from_its_checkpoint_writes_the_same_bytes(tmp_path) -> None:
    """Also when the checkpoint is written from a snapshot after the training went on from
    the same state (as it does while a checkpoint uploads): nothing in it moved along."""
    shard = spec(lr=1e-3, lr_schedule="cosine", lr_warmup=1, grad_accumulation=2, ema=0.9)
    written, resumed = going_on_and_resumed(shard, tmp_path)
    assert resumed.step == 4
    assert written["going-on"] == written["resumed"]
    assert {path.name for path in written["resumed"]} >= {"training.json", "training.safetensors"}


def test_a_gpu_trains_in_bf16_on_tf32_and_autotuned_kernels_and_a_cpu_is_left_as_it_is() -> None:
    """The GPU defaults: bf16 autocast unless asked otherwise, TF32 for what stays fp32,
    cuDNN's autotuner. A torch.device names a GPU without one being there."""
    cudnn = torch.backends.cudnn
    flags = [
        (torch.backends.cuda.matmul, "allow_tf32"),
        (cudnn, "allow_tf32"),
        (cudnn, "benchmark"),
    ]
    before = [getattr(owner, name) for owner, name in flags]
    try:
        for owner, name in flags:
            setattr(owner, name, False)
        use_fast_kernels(torch.device("cpu"))
        assert [getattr(owner, name) for owner, name in flags] == [False] * 3
        use_fast_kernels(torch.device("cuda", 0))
        assert [getattr(owner, name) for owner, name in flags] == [True] * 3
    finally:
        for (owner, name), value in zip(flags, before, strict=True):
            setattr(owner, name, value)
    assert autocast_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert autocast_dtype("auto", torch.device("cpu")) is None
    assert autocast_dtype("fp16", torch.device("cuda", 0)) == torch.float16


@pytest.mark.parametrize(("accumulation", "static"), [(1, True), (2, False)])
def test_ddp_keeps_gradients_in_its_buckets_and_a_static_graph_where_it_can(
    accumulation: int, static: bool, tmp_path
) -> None:
    """DDP as a rank builds it (a one-rank gloo group here): gradients as views of its
    buckets, and the static graph except beside no_sync (gradient accumulation)."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        options = spec(grad_accumulation=accumulation).options
        model = _data_parallel(build_unet(), options, torch.device("cpu"))
        assert (model.gradient_as_bucket_view, model.static_graph) == (True, static)
    finally:
        dist.destroy_process_group()


def test_one_loss_not_finite_is_no_divergence_three_in_a_row_are() -> None:
    """An fp16 forward that overflowed once (its update skipped by the gradient scaler) goes
    on; a loss not finite three steps in a row, across windows of losses, is a divergence
    from its first."""
    nan, inf = float("nan"), float("inf")

    def steps(first: int, *losses: float) -> list[dict]:
        return [{"step": first + n, "loss": loss} for n, loss in enumerate(losses)]

    watch = DivergenceWatch()
    watch.see(steps(1, 1.0, nan, 0.9, inf, nan))
    with pytest.raises(Diverged, match="the loss is inf at step 4 and not finite since"):
        watch.see(steps(6, nan))
