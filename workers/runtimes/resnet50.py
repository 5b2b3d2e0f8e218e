"""ResNet-50 image classification: torchvision's architecture, weights from a file.

Inputs are encoded images (base64 JPEG or PNG). They are decoded and resized
on a pool of CPU threads (Pillow releases the GIL while it works), resized so
the shorter side is 256/224 of ``image_size`` and centre-cropped to
``image_size`` square, normalised with ImageNet's mean and deviation, and run
in ``channels_last`` layout. Each output is the top five ImageNet classes with
their probabilities, and says where the weights came from.

The weights are a ``state_dict`` file (``FERRY_RESNET50_WEIGHTS``, for example
torchvision's ``resnet50-11ad3fa6.pth``). Random weights are used only when
``FERRY_RESNET50_RANDOM_WEIGHTS`` asks for them (benchmarks), and then every
output says ``"weights": "random"``. The network is torchvision's when it is
installed; otherwise the same architecture, with the same parameter names, is
built here, so the same weight files load into either.
"""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from workers.runtimes.base import autocast
from workers.runtimes.cuda import PinnedStager, TorchRuntime

# Activations per input pixel, a deliberate over-estimate (about 100 MB per
# 224 x 224 image in fp32) used where peak memory cannot be measured.
DECLARED_BYTES_PER_PIXEL = 2048
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


class ResNet50Runtime(TorchRuntime):
    name = "resnet50"
    padded = False  # every image is resized to the same shape

    def __init__(
        self,
        device: str,
        weights: Path | None,
        random_weights: bool = False,
        image_size: int = 224,
        precision: str = "fp32",
        budget_bytes: int | None = None,
        warmup_batch: int = 1,
        memory_fraction: float = 0.9,
        reclaim_bytes: int = 2**30,
        decode_threads: int = 4,
    ) -> None:
        if weights is None and not random_weights:
            raise ValueError(
                "resnet50 needs weights: set FERRY_RESNET50_WEIGHTS to a state_dict file "
                "(or FERRY_RESNET50_RANDOM_WEIGHTS=true for a benchmark)"
            )
        super().__init__(
            device, precision, budget_bytes, warmup_batch, memory_fraction, reclaim_bytes
        )
        self.weights = weights
        self.weights_kind = "file" if weights is not None else "random"
        self.image_size = image_size
        self._pool = ThreadPoolExecutor(decode_threads, thread_name_prefix="resnet50-decode")

    def load(self) -> None:
        import torch

        self._take_device()
        if self.weights is None:
            torch.manual_seed(0)  # the same random network in every process
        model = build_resnet50()
        if self.weights is not None:
            state = torch.load(self.weights, map_location="cpu", weights_only=True)
            try:
                result = model.load_state_dict(state, strict=False)
            except RuntimeError as exc:  # tensors of the wrong shapes
                raise ValueError(f"{self.weights} is not a ResNet-50 state_dict: {exc}") from exc
            # Older files lack the batch norms' counters, which inference never reads.
            missing = [k for k in result.missing_keys if not k.endswith("num_batches_tracked")]
            if missing or result.unexpected_keys:
                raise ValueError(
                    f"{self.weights} is not a ResNet-50 state_dict "
                    f"(missing {missing[:3]}, unexpected {result.unexpected_keys[:3]})"
                )
        self._weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self._model = model.to(self.device, memory_format=torch.channels_last).eval()
        blank = _encoded_blank(self.image_size)
        self._warm_up(blank, blank)

    @property
    def cost(self) -> int:
        """Every input's cost: its pixels after the resize."""
        return self.image_size * self.image_size

    def declared_memory(self) -> tuple[float, float]:
        return float(self._weights_bytes), float(DECLARED_BYTES_PER_PIXEL)

    def calibrate(self) -> tuple[float, float, float] | None:
        blank = _encoded_blank(self.image_size)
        small = self._timed(self.run, [blank])
        large_items = 4
        large = self._timed(self.run, [blank] * large_items)
        slope = max(0.0, (large - small) / ((large_items - 1) * self.cost))
        return max(0.0, small - slope * self.cost), slope, float(large_items * self.cost)

    def _host_inputs(self, inputs: list[Any], stager: PinnedStager | None) -> list[Any]:
        """Decode on the pool's threads, each image straight into its row of the batch."""
        import torch

        shape = (len(inputs), 3, self.image_size, self.image_size)
        if stager is None:
            batch = torch.empty(shape, dtype=torch.float32)
        else:
            batch = stager.buffer("images", shape, torch.float32)
        rows = batch.numpy()

        def decode_into(row: int) -> None:
            rows[row] = self._decode(inputs[row])

        for done in [self._pool.submit(decode_into, row) for row in range(len(inputs))]:
            done.result()  # the first image that failed to decode fails the batch
        return [batch]

    def _decode(self, encoded: Any) -> Any:
        """base64 image -> normalised float32 array, 3 x size x size (on a pool thread)."""
        import numpy as np
        from PIL import Image, ImageOps

        data = base64.b64decode(str(encoded), validate=True)
        size = self.image_size
        with Image.open(io.BytesIO(data)) as image:
            # A JPEG may decode straight to a smaller scale: less work, same result.
            image.draft("RGB", (size * 2, size * 2))
            upright = ImageOps.exif_transpose(image)
            if upright.mode.startswith("I"):  # 16-bit greyscale: to 8 bits, not clipped
                wide = np.asarray(upright, dtype=np.float32)
                scale = 257.0 if float(wide.max()) > 255 else 1.0
                upright = Image.fromarray(np.clip(wide / scale, 0, 255).astype(np.uint8))
            rgb = upright.convert("RGB")
        # The centre square that, resized so its side is 256/224 of ``size``,
        # holds the ``size`` crop: only that region is resized, so an image of
        # any shape costs at most size x size pixels here.
        width, height = rgb.size
        side = min(width, height) * 224 / 256
        left, top = (width - side) / 2, (height - side) / 2
        crop = rgb.resize(
            (size, size), Image.Resampling.BILINEAR, box=(left, top, left + side, top + side)
        )
        scaled: Any = np.asarray(crop, dtype=np.float32) / np.float32(255.0)
        normal = (scaled - np.asarray(MEAN, dtype=np.float32)) / np.asarray(STD, dtype=np.float32)
        return normal.transpose(2, 0, 1)

    def _forward(self, images: Any) -> Any:
        import torch

        with autocast(self.device, self.precision):
            logits = self._model(images.contiguous(memory_format=torch.channels_last))
        return logits.float()

    def _outputs(self, logits: Any) -> list[Any]:
        import torch

        probabilities = torch.softmax(logits, dim=1)
        scores, classes = probabilities.topk(5, dim=1)
        return [
            {
                "top5": [
                    {"class": int(c), "score": round(float(s), 6)}
                    for c, s in zip(row_classes.tolist(), row_scores.tolist(), strict=True)
                ],
                "weights": self.weights_kind,
            }
            for row_classes, row_scores in zip(classes, scores, strict=True)
        ]


def build_resnet50() -> Any:
    """torchvision's ResNet-50 (v1.5: the stride in the 3 x 3 convolution), untrained."""
    try:
        from torchvision.models import resnet50

        return resnet50(weights=None)
    except Exception:  # not installed, or a build that does not match this torch
        return _resnet50()


def _resnet50() -> Any:
    from torch import nn

    class Bottleneck(nn.Module):
        expansion = 4

        def __init__(
            self, inplanes: int, planes: int, stride: int = 1, downsample: Any = None
        ) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(planes * 4)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = downsample

        def forward(self, x: Any) -> Any:
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            return self.relu(out + identity)

    class ResNet(nn.Module):
        def __init__(self, layers: tuple[int, ...] = (3, 4, 6, 3), classes: int = 1000) -> None:
            super().__init__()
            self.inplanes = 64
            self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
            self.layer1 = self._layer(64, layers[0])
            self.layer2 = self._layer(128, layers[1], stride=2)
            self.layer3 = self._layer(256, layers[2], stride=2)
            self.layer4 = self._layer(512, layers[3], stride=2)
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            self.fc = nn.Linear(512 * 4, classes)
            for module in self.modules():
                if isinstance(module, nn.Conv2d):
                    nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
                elif isinstance(module, nn.BatchNorm2d):
                    nn.init.constant_(module.weight, 1)
                    nn.init.constant_(module.bias, 0)

        def _layer(self, planes: int, blocks: int, stride: int = 1) -> Any:
            downsample = None
            if stride != 1 or self.inplanes != planes * 4:
                downsample = nn.Sequential(
                    nn.Conv2d(self.inplanes, planes * 4, 1, stride=stride, bias=False),
                    nn.BatchNorm2d(planes * 4),
                )
            layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
            self.inplanes = planes * 4
            layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
            return nn.Sequential(*layers)

        def forward(self, x: Any) -> Any:
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(self.avgpool(x).flatten(1))

    return ResNet()


def _encoded_blank(size: int) -> str:
    """A grey PNG, base64: what warm-up and calibration run."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (128, 128, 128)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()
