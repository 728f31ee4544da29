"""LoRA training (`sdq train --lora-rank`), in the process: only the adapters train, a
checkpoint holds them and their optimizer state alone and resumes to the same bytes, and
the run's LoRA file is one diffusers' own `load_lora_weights` reads into the U-Net the
training had."""

import hashlib
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionPipeline
from PIL import Image
from safetensors.torch import load_file

from sdq.models.train.specs import LORA_FILE
from sdq.workers.tiny import build_pipeline, build_unet
from sdq.workers.train.loop.build import new_state
from sdq.workers.train.loop.checkpoints import snapshot
from sdq.workers.train.loop.lora import save_lora_file
from sdq.workers.train.loop.step import training_flops_per_sample
from tests.conftest import ROOT, run_sdq, sdq_json
from tests.netns_download import DOWNLOAD_ENV
from tests.services import clean_env
from tests.test_train import TRAIN, encoded_dataset
from tests.test_trainer import batch, going_on_and_resumed, spec, step

LORA = {"lora_rank": 4, "lora_alpha": 8.0, "lr": 1e-2}


def test_only_the_adapters_train_and_the_base_stays_as_it_was() -> None:
    shard = spec(**LORA, ema=0.9)
    base = {name: weight.clone() for name, weight in build_unet().state_dict().items()}
    state = new_state(shard, build_unet())
    adapters = {name: p.detach().clone() for name, p in state.unet.named_parameters()
                if p.requires_grad}  # fmt: skip
    assert adapters and all(".lora_A." in name or ".lora_B." in name for name in adapters)
    for seed in (0, 1):
        step(state, shard, *batch(seed))
    after = dict(state.unet.named_parameters())
    # Every adapter weight moved (the up weights start at zero: the model starts as its base).
    assert all(not torch.equal(after[name], weight) for name, weight in adapters.items())
    frozen = {name.replace(".base_layer", ""): p for name, p in after.items()
              if name not in adapters}  # fmt: skip
    assert frozen.keys() == base.keys()
    assert all(torch.equal(frozen[name], base[name]) for name in base)
    # The optimizer and the EMA follow the adapters alone.
    assert len(state.optimizer.state) == len(adapters) == len(state.ema.shadow_params)
    # A checkpoint's model takes each adapter weight's own EMA shadow, by name.
    shadows = dict(zip(adapters, state.ema.shadow_params, strict=True))
    taken = snapshot(state)
    assert taken.model_weights.keys() == {name.replace(".default", "") for name in adapters}
    for name, shadow in shadows.items():
        assert torch.equal(taken.model_weights[name.replace(".default", "")], shadow)


def test_under_autocast_the_frozen_weights_are_kept_in_its_precision() -> None:
    """As diffusers' LoRA script keeps them (bf16 here, on the CPU, asked for): the adapters
    train in fp32, and a step moves them."""
    shard = spec(**LORA, mixed_precision="bf16", ema=None)
    state = new_state(shard, build_unet())
    dtypes = {(p.requires_grad, p.dtype) for p in state.unet.parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}
    before = [p.detach().clone() for p in state.trained]
    step(state, shard, *batch(0))
    assert all(not torch.equal(p, old) for p, old in zip(state.trained, before, strict=True))


def test_a_lora_s_flops_are_two_forward_passes_at_its_precision() -> None:
    """Its frozen weights take no gradient: a step is the forward and the activations'
    backward, where a whole U-Net's backward also computes every weight's gradient. Counted
    under the run's autocast (bf16 here), where the frozen weights are kept."""
    whole, lora = spec(mixed_precision="bf16"), spec(**LORA, mixed_precision="bf16")
    counted = {
        name: training_flops_per_sample(new_state(shard, build_unet()), shard, *batch(0))
        for name, shard in (("whole", whole), ("lora", lora))
    }
    # The adapters' own matmuls add a few percent to the forward pass.
    assert 2 / 3 < counted["lora"] / counted["whole"] < 2 / 3 * 1.1


def test_compiled_by_block_a_lora_trains_as_it_does_eagerly() -> None:
    """`--compile` compiles each transformer block whole (fullgraph) with peft's layers in
    it: the same losses as the eager steps (inductor's C++ backend on the CPU, ~35 s)."""
    losses = {}
    for compiled in (False, True):
        shard = spec(**LORA, compile=compiled, ema=None)
        state = new_state(shard, build_unet())
        losses[compiled] = [step(state, shard, *batch(seed)) for seed in (0, 1, 2)]
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


def test_a_checkpoint_holds_the_adapters_and_resumes_to_the_same_bytes(tmp_path: Path) -> None:
    """As a whole U-Net's does, after the training went on from the same state while the
    snapshot was written; the state is the adapters and their optimizer state alone."""
    shard = spec(**LORA, lr_schedule="cosine", lr_warmup=1, ema=0.9)
    written, resumed = going_on_and_resumed(shard, tmp_path)
    assert resumed.lora
    assert written["going-on"] == written["resumed"]
    assert {path.name for path in written["resumed"]} == {
        "adapter.safetensors", "training.json", "training.safetensors"
    }  # fmt: skip
    adapter_bytes = tensor_bytes(load_file(tmp_path / "resumed/adapter.safetensors"))
    # Besides the adapter: its EMA and AdamW's two moments (and 0-d step counts), no U-Net.
    training = load_file(tmp_path / "resumed/training.safetensors")
    assert tensor_bytes({n: w for n, w in training.items() if w.dim()}) == 3 * adapter_bytes
    assert tensor_bytes(build_unet().state_dict()) > 10 * adapter_bytes


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


@pytest.mark.parametrize("targets", ["attention", "attention+ff"])
def test_the_lora_file_is_what_diffusers_loads_into_the_u_net_that_trained(
    tmp_path: Path, targets: str
) -> None:
    """The file's weights at the alpha the run trained with (8 over rank 4, from the file's
    metadata), read by diffusers' own loader into the base pipeline, make the trained
    U-Net's prediction."""
    shard = spec(**LORA, lora_targets=targets, ema=None)
    state = new_state(shard, build_unet())
    for seed in (0, 1):
        step(state, shard, *batch(seed))
    taken = snapshot(state)
    path = save_lora_file(taken.model_weights, shard.options, tmp_path)
    assert path.name == LORA_FILE
    trained = [name for name, _ in state.unet.named_parameters() if ".lora_" in name]
    assert any(".ff." in name for name in trained) == (targets == "attention+ff")

    pipeline = build_pipeline()
    pipeline.load_lora_weights(tmp_path, weight_name=LORA_FILE)
    latents, embeddings = batch(5)
    timesteps = torch.tensor([10, 500])
    with torch.no_grad():
        state.unet.eval()
        expected = state.unet(latents, timesteps, embeddings).sample
        loaded = pipeline.unet(latents, timesteps, embeddings).sample
        base = build_unet()(latents, timesteps, embeddings).sample
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-5)
    assert (expected - base).abs().max() > 1e-3  # the adapters changed what it predicts
    assert isinstance(pipeline, StableDiffusionPipeline)


# A short train of the test's dataset, for what is refused before anything is written.
SHORT = ("train", "toy", *TRAIN, "--steps", "4")


def _refused(env: dict[str, str], cwd: Path, *command: str) -> str:
    """What a command that is refused says."""
    refused = run_sdq(env, *command, cwd=cwd)
    assert refused.returncode == 2, refused.stderr
    return " ".join(refused.stderr.split())


def _image(store: Path, database: Path, job_id: int) -> np.ndarray:
    with sqlite3.connect(database) as db:
        [spec_hash] = db.execute("SELECT spec_hash FROM jobs WHERE id = ?", (job_id,)).fetchone()
    return np.asarray(Image.open(store / f"images/{spec_hash}.png"), dtype=np.int16)


def test_a_lora_run_renders_by_name_resumes_exactly_and_leads_back_to_its_urls(
    tmp_path: Path,
) -> None:
    """Embedded, end to end: a LoRA trained in two jobs, registered by its --into name, its
    validation rendered over the base at each checkpoint; rendered with `--lora NAME` and
    `--lora NAME@STEP`, pushed under another name, and from its image back to the URLs it
    learned from. One job of all its steps makes the same file, byte for byte; two ranks
    follow one's losses. What cannot train is refused before anything is written."""
    env = {**clean_env(), **DOWNLOAD_ENV, "PYTHONPATH": str(ROOT)}
    encoded_dataset(env, "toy", 16, tmp_path)
    database, store = tmp_path / "sdq-data/sdq.db", tmp_path / "sdq-data/store"
    assert "'--lora-rank': 0 is not in the range x>=1" in _refused(
        env, tmp_path, *SHORT, "--lora-rank", "0"
    )
    assert "give --sharding none" in _refused(
        env, tmp_path, *SHORT, "--lora-rank", "4", "--sharding", "grad-op", "--world-size", "2"
    )
    assert "shape a LoRA: give --lora-rank" in _refused(env, tmp_path, *SHORT, "--lora-alpha", "8")
    assert "--from-scratch has none to adapt" in _refused(
        env, tmp_path, *SHORT, "--lora-rank", "4", "--from-scratch"
    )
    assert "a LoRA run's models are LoRA files" in _refused(
        env,
        tmp_path,
        *SHORT,
        "--lora-rank",
        "4",
        "--holdout",
        "0.25",
        "--eval-metrics",
        "heldout_loss",
    )
    with sqlite3.connect(database) as db:
        assert db.execute("SELECT count(*) FROM runs WHERE kind = 'train'").fetchone() == (0,)

    validation = tmp_path / "validation.csv"
    validation.write_text("prompt,seed\na red square,7\na blue circle,8\n")
    lora = [*TRAIN, "--steps", "40", "--lr", "1e-2", "--lora-rank", "4", "--lora-alpha", "8"]
    trained = sdq_json(env, "train", "toy", *lora, "--checkpoint-every", "20",
                       "--into", "toy-lora", "--validation-prompts", str(validation),
                       cwd=tmp_path)  # fmt: skip
    assert (trained["status"], [c["step"] for c in trained["checkpoints"]]) == (
        "succeeded",
        [20, 40],
    )
    assert trained["lora_rank"] == 4
    shown = subprocess.run(
        [sys.executable, "-m", "sdq.producer.cli", "train", "status", str(trained["run_id"])],
        env=env, cwd=tmp_path, capture_output=True, text=True, check=True,
    )  # fmt: skip
    said = " ".join(shown.stdout.split())
    assert "render with: sdq run PROMPTS --model tiny --lora toy-lora@STEP (STEP: 20, 40)" in said
    whole = sdq_json(env, "train", "toy", *lora, "--checkpoint-every", "40", cwd=tmp_path)
    assert whole["losses"] == trained["losses"]
    # Two ranks (DDP over the adapters) follow one rank's loss curve, within float rounding.
    two = sdq_json(env, "train", "toy", *lora, "--checkpoint-every", "40", "--world-size", "2",
                   cwd=tmp_path)  # fmt: skip
    assert [step for step, _ in two["losses"]] == [step for step, _ in whole["losses"]]
    assert [loss for _, loss in two["losses"]] == pytest.approx(
        [loss for _, loss in whole["losses"]], rel=1e-3
    )
    assert (
        whole["checkpoints"][-1]["model_revision"] == trained["checkpoints"][-1]["model_revision"]
    )
    checkpoint = store / f"train/{trained['run_id']}/checkpoints/00000040"
    assert sorted(p.name for p in (checkpoint / "state").iterdir()) == [
        "adapter.safetensors", "training.json", "training.safetensors"
    ]  # fmt: skip
    lora_file = checkpoint / f"model/{LORA_FILE}"
    assert [p.name for p in (checkpoint / "model").iterdir()] == [LORA_FILE]
    assert (
        hashlib.sha256(lora_file.read_bytes()).hexdigest()
        == whole["checkpoints"][-1]["model_revision"]
    )
    # Each checkpoint's validation renders: the base with that checkpoint's LoRA.
    page = (store / f"runs/{trained['run_id']}/training.html").read_text()
    images = re.findall(r'<img src="\.\./\.\./(images/\w+\.png)"', page)
    assert len(images) == len(set(images)) == 4

    prompts = tmp_path / "prompts.csv"
    prompts.write_text("prompt,seed\na picture,1\n")
    render = ["--model", "tiny", "--steps", "2", "--dtype", "float32", "--size", "64x64"]
    jobs = {
        name: sdq_json(env, "run", str(prompts), *render, *extra, cwd=tmp_path)["jobs"][0]["id"]
        for name, extra in [
            ("base", []),
            ("newest", ["--lora", "toy-lora"]),
            ("at-20", ["--lora", "toy-lora@20"]),
        ]
    }
    base, newest, at_20 = (_image(store, database, jobs[name]) for name in jobs)
    assert np.abs(newest - base).max() > 8 and np.abs(newest - at_20).max() > 0
    pushed = sdq_json(env, "model", "push", "toy-lora@20", "kept-lora", cwd=tmp_path)
    assert (pushed["run"], pushed["step"], pushed["uploaded"]) == (trained["run_id"], 20, True)
    assert pushed["revision"] == trained["checkpoints"][0]["model_revision"]
    kept = sdq_json(env, "run", str(prompts), *render, "--lora", "kept-lora", cwd=tmp_path)
    assert np.array_equal(_image(store, database, kept["jobs"][0]["id"]), at_20)
    said = _refused(env, tmp_path, "run", str(prompts), "--model", "toy-lora@40")
    assert "is a LoRA a train run made, not a pipeline: a render takes it with --lora" in said
    # Nor a base to train on: what the message says works in training's command too.
    said = _refused(env, tmp_path, "train", "toy", "--base", "toy-lora", "--resolution", "64",
                    "--steps", "4", "--lora-rank", "4")  # fmt: skip
    assert "a render takes it with --lora toy-lora over its base" in said
    # A LoRA run goes on from no checkpoint, and none goes on from a LoRA run's.
    resumed = ("train", "toy", "--resolution", "64", "--batch-size", "4", "--steps", "4")
    said = _refused(env, tmp_path, *resumed, "--resume-from", "1", "--lora-rank", "4")
    assert "to adapt a checkpoint's model, give it as --base RUN@STEP" in said
    said = _refused(env, tmp_path, *resumed, "--resume-from", str(trained["run_id"]))
    assert "trained a LoRA; its checkpoints hold adapters, not a U-Net to go on from" in said

    with sqlite3.connect(database) as db:
        sources = db.execute(
            "SELECT train_run_id, step, url, caption FROM image_sources WHERE job_id = ?",
            (jobs["newest"],),
        ).fetchall()
        kept_samples = db.execute(
            "SELECT url, caption FROM samples WHERE status = 'success'"
        ).fetchall()
    # Both runs made this very file (the one-job run too): it leads back through each.
    assert {(run, step, url, caption) for run, step, url, caption in sources} == {
        (run, 40, url, caption)
        for run in (trained["run_id"], whole["run_id"])
        for url, caption in kept_samples
    }
    assert len(kept_samples) == 16
