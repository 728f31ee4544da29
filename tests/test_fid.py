"""fid: sdq's Inception-v3 against torch-fidelity's own source, the graph torchmetrics'
FrechetInceptionDistance runs, with the same weights file: the same features, layer names
and FID. The pt_inception weights cannot be downloaded here, so the file is random weights
with batch norm's statistics taken from images (features that differ from image to image).

torch-fidelity needs torchvision at import, which does not install beside this torch: the
README's test command downloads its wheel, unpacked here without its package's __init__."""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import click
import numpy as np
import pytest
import torch
from PIL import Image

from sdq.producer.evaluate.request import resolve_fid_weights
from sdq.workers.evaluate.inception import FidInceptionV3
from sdq.workers.evaluate.metrics import frechet_distance, inception_features

REFERENCE = Path(sys.prefix) / "reference"
# The modules torch-fidelity's Inception-v3 needs, none of which imports torchvision.
FIDELITY_MODULES = ("feature_extractor_inceptionv3", "feature_extractor_base", "helpers",
                    "defaults", "deprecations", "interpolate_compat_tensorflow")  # fmt: skip

PLAIN = """
import json, sys
import numpy as np, torch
from PIL import Image
from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
from torchmetrics.image.fid import FrechetInceptionDistance

weights, fake, real = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
extractor = FeatureExtractorInceptionV3("inception-v3-compat", ["2048"],
                                        feature_extractor_weights_path=weights)

class Pool(torch.nn.Module):
    def forward(self, images):
        return extractor(images)[0]

def uint8(path):
    return torch.from_numpy(np.asarray(Image.open(path).convert("RGB"))).permute(2, 0, 1)[None]

fid = FrechetInceptionDistance(feature=Pool())
features = []
for paths, is_real in ((fake, False), (real, True)):
    for path in paths:
        fid.update(uint8(path), real=is_real)
        features.append(extractor(uint8(path))[0][0].tolist())
print(json.dumps({"fid": float(fid.compute()), "features": features}))
"""


def fidelity_source(folder: Path) -> Path:
    """torch-fidelity's Inception-v3 modules from its wheel, importable from `folder`."""
    wheels = sorted(REFERENCE.glob("torch_fidelity-*.whl"))
    assert wheels, f"no torch-fidelity wheel in {REFERENCE}: the README's test command gets it"
    package = folder / "torch_fidelity"
    package.mkdir(parents=True)
    with zipfile.ZipFile(wheels[-1]) as wheel:
        for module in FIDELITY_MODULES:
            (package / f"{module}.py").write_bytes(wheel.read(f"torch_fidelity/{module}.py"))
    (package / "__init__.py").write_text("")
    return folder


def random_fid_weights(path: Path) -> Path:
    """The FID graph's weights file: random, batch norm's running statistics those of a
    few random images (with its own, every image's features would be alike)."""
    torch.manual_seed(0)
    model = FidInceptionV3()
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.momentum = None  # a plain mean over the batch
    with torch.no_grad():
        model.train()(torch.randint(0, 256, (6, 3, 96, 96), dtype=torch.uint8))
    torch.save(model.eval().state_dict(), path)
    return path


def _pngs(folder: Path, sizes: list[tuple[int, int]], seed: int) -> list[Path]:
    draw = np.random.default_rng(seed)
    folder.mkdir()
    paths = []
    for number, (width, height) in enumerate(sizes):
        pixels = draw.integers(0, 256, (height, width, 3), dtype=np.uint8)
        # Smooth noise, so that resizing has something to interpolate.
        image = Image.fromarray(pixels).resize((width // 4, height // 4)).resize((width, height))
        image.save(folder / f"{number}.png")
        paths.append(folder / f"{number}.png")
    return paths


def test_sdq_s_inception_is_torch_fidelity_s_and_its_fid_torchmetrics(tmp_path: Path) -> None:
    weights = random_fid_weights(tmp_path / "inception.pth")
    # Renders of one size, real images of several, as a dataset's are.
    fake = _pngs(tmp_path / "fake", [(64, 64)] * 5, seed=1)
    real = _pngs(tmp_path / "real", [(96, 96), (128, 80), (300, 310), (64, 64), (72, 120)], 2)
    plain = subprocess.run(
        [sys.executable, "-c", PLAIN, str(weights), json.dumps(list(map(str, fake))),
         json.dumps(list(map(str, real)))],
        env={"PYTHONPATH": str(fidelity_source(tmp_path / "fidelity"))},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    wanted = json.loads(plain.stdout)

    model = FidInceptionV3()
    # Strict: every tensor of torch-fidelity's file is one of this graph's, by name.
    model.load_state_dict(torch.load(weights, weights_only=True))
    model.eval()
    fake_features = inception_features(model, [path.read_bytes() for path in fake])
    real_features = inception_features(model, [path.read_bytes() for path in real])
    np.testing.assert_allclose(
        np.concatenate([fake_features, real_features]), wanted["features"], rtol=1e-4, atol=1e-4
    )
    assert np.std(fake_features, axis=0).mean() > 0.05  # the images' features differ
    value = frechet_distance(fake_features, real_features)
    assert value > 1 and abs(value - wanted["fid"]) <= 1e-3 * wanted["fid"]


def test_weights_are_named_by_their_content_and_refused_when_not_torch_s(tmp_path: Path) -> None:
    weights = random_fid_weights(tmp_path / "inception.pth")
    resolved = resolve_fid_weights(str(weights))
    assert resolved.source == str(weights.resolve()) and len(resolved.sha256) == 64
    (tmp_path / "copy.pth").write_bytes(weights.read_bytes())
    assert resolve_fid_weights(str(tmp_path / "copy.pth")).sha256 == resolved.sha256
    text = tmp_path / "notes.txt"
    text.write_text("not weights")
    for path, message in [(tmp_path / "none.pth", "--fid-weights: no file"),
                          (text, "is not a PyTorch weights file")]:  # fmt: skip
        with pytest.raises(click.UsageError, match=message):
            resolve_fid_weights(str(path))
