"""Inception-v3 as FID is defined: the TensorFlow graph of the FID paper (Heusel et al.,
2017, weights pt_inception-2015-12-05) as torch-fidelity ports it, and torchmetrics'
FrechetInceptionDistance runs it. Its 2048 pool features of uint8 RGB images resized to
299 px with TensorFlow 1.x's bilinear resize. The parameter names are the port's, so the
weights file those tools load (`--fid-weights`) loads here as it is.

Written here because torch-fidelity needs torchvision at import; tests/test_fid.py checks
this graph, feature for feature, against torch-fidelity's own source.

The graph differs from torchvision's Inception-v3 where TensorFlow's did: batch norm's
epsilon is 1e-3, average pools leave the padding out of the mean, and the last block pools
by max where torchvision averages."""

import torch
import torch.nn.functional as F
from torch import nn

SIZE = 299
FEATURES = 2048


class BasicConv2d(nn.Module):
    def __init__(self, channels_in: int, channels_out: int, kernel, stride=1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(channels_in, channels_out, kernel, stride, padding, bias=False)
        self.bn = nn.BatchNorm2d(channels_out, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


def _mean_pool(x: torch.Tensor) -> torch.Tensor:
    """TensorFlow's 3x3 average pool: the padding is not counted in the mean."""
    return F.avg_pool2d(x, kernel_size=3, stride=1, padding=1, count_include_pad=False)


class InceptionA(nn.Module):
    def __init__(self, channels: int, pool_features: int) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(channels, 64, 1)
        self.branch5x5_1 = BasicConv2d(channels, 48, 1)
        self.branch5x5_2 = BasicConv2d(48, 64, 5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(channels, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, padding=1)
        self.branch_pool = BasicConv2d(channels, pool_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        double = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([
            self.branch1x1(x),
            self.branch5x5_2(self.branch5x5_1(x)),
            double,
            self.branch_pool(_mean_pool(x)),
        ], 1)  # fmt: skip


class InceptionB(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.branch3x3 = BasicConv2d(channels, 384, 3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(channels, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        double = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([self.branch3x3(x), double, F.max_pool2d(x, 3, stride=2)], 1)


class InceptionC(nn.Module):
    def __init__(self, channels: int, channels_7x7: int) -> None:
        super().__init__()
        c7 = channels_7x7
        self.branch1x1 = BasicConv2d(channels, 192, 1)
        self.branch7x7_1 = BasicConv2d(channels, c7, 1)
        self.branch7x7_2 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, 192, (7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(channels, c7, 1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, (1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(channels, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        single = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        double = self.branch7x7dbl_1(x)
        for layer in (self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4,
                      self.branch7x7dbl_5):  # fmt: skip
            double = layer(double)
        return torch.cat([self.branch1x1(x), single, double, self.branch_pool(_mean_pool(x))], 1)


class InceptionD(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.branch3x3_1 = BasicConv2d(channels, 192, 1)
        self.branch3x3_2 = BasicConv2d(192, 320, 3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(channels, 192, 1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, (1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, (7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seven = self.branch7x7x3_1(x)
        for layer in (self.branch7x7x3_2, self.branch7x7x3_3, self.branch7x7x3_4):
            seven = layer(seven)
        three = self.branch3x3_2(self.branch3x3_1(x))
        return torch.cat([three, seven, F.max_pool2d(x, 3, stride=2)], 1)


class InceptionE(nn.Module):
    """Mixed_7b pools by mean, Mixed_7c by max (as TensorFlow's graph does)."""

    def __init__(self, channels: int, max_pool: bool) -> None:
        super().__init__()
        self.max_pool = max_pool
        self.branch1x1 = BasicConv2d(channels, 320, 1)
        self.branch3x3_1 = BasicConv2d(channels, 384, 1)
        self.branch3x3_2a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(channels, 448, 1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, 3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(channels, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        single = self.branch3x3_1(x)
        single = torch.cat([self.branch3x3_2a(single), self.branch3x3_2b(single)], 1)
        double = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        double = torch.cat([self.branch3x3dbl_3a(double), self.branch3x3dbl_3b(double)], 1)
        pooled = F.max_pool2d(x, 3, stride=1, padding=1) if self.max_pool else _mean_pool(x)
        return torch.cat([self.branch1x1(x), single, double, self.branch_pool(pooled)], 1)


class FidInceptionV3(nn.Module):
    """Images (N x 3 x H x W, uint8) to their pool features (N x 2048, float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, 3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, 3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, 3, padding=1)
        self.MaxPool_1 = nn.MaxPool2d(3, stride=2)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, 1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, 3)
        self.MaxPool_2 = nn.MaxPool2d(3, stride=2)
        self.Mixed_5b = InceptionA(192, pool_features=32)
        self.Mixed_5c = InceptionA(256, pool_features=64)
        self.Mixed_5d = InceptionA(288, pool_features=64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = InceptionC(768, channels_7x7=128)
        self.Mixed_6c = InceptionC(768, channels_7x7=160)
        self.Mixed_6d = InceptionC(768, channels_7x7=160)
        self.Mixed_6e = InceptionC(768, channels_7x7=192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = InceptionE(1280, max_pool=False)
        self.Mixed_7c = InceptionE(2048, max_pool=True)
        self.AvgPool = nn.AdaptiveAvgPool2d(1)
        # The classifier is in the weights file; FID reads the features before it.
        self.fc = nn.Linear(FEATURES, 1008)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.pool_features(resize_like_tensorflow(images.float(), SIZE))

    def pool_features(self, resized: torch.Tensor) -> torch.Tensor:
        """The features of images already resized to 299 px (float, 0-255)."""
        x = (resized - 128) / 128
        for layer in list(self.children())[:-1]:  # up to the pool, not the classifier
            x = layer(x)
        return torch.flatten(x, 1)


def resize_like_tensorflow(images: torch.Tensor, size: int) -> torch.Tensor:
    """TensorFlow 1.x's bilinear resize (align_corners=False, no half-pixel centres), which
    the FID graph begins with: source pixel i * in/out, its right and lower neighbours
    clamped at the edge."""

    def grid(length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        where = torch.arange(size, dtype=images.dtype, device=images.device)
        where = where * torch.tensor(length / size, dtype=torch.float32)
        low = where.long()
        return low, (low + 1).clamp_max(length - 1), where - low.float()

    top, bottom, down = grid(images.shape[2])
    left, right, across = grid(images.shape[3])
    rows_top, rows_bottom = images[:, :, top, :], images[:, :, bottom, :]
    upper = rows_top[:, :, :, left] + (rows_top[:, :, :, right] - rows_top[:, :, :, left]) * across
    lower = (rows_bottom[:, :, :, left]
             + (rows_bottom[:, :, :, right] - rows_bottom[:, :, :, left]) * across)  # fmt: skip
    return upper + (lower - upper) * down.view(1, 1, size, 1)


def load_fid_inception(state: dict[str, torch.Tensor]) -> FidInceptionV3:
    """The graph with the weights file's tensors (every one, no other: strict), in eval
    mode, frozen, in float32 as the tools that define FID run it."""
    model = FidInceptionV3()
    model.load_state_dict(state)
    return model.eval().requires_grad_(False)
