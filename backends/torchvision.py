"""The ``torchvision`` backend: image classification with a torchvision architecture.

``architecture`` names the network (``resnet50`` by default: torchvision's
ResNet-50, or a built-in copy of it with the same parameter names when
torchvision is absent; any other name needs torchvision).

Inputs are encoded images (base64 JPEG or PNG). They are decoded and resized
on a pool of CPU threads (Pillow releases the GIL while it works), resized so
the shorter side is 256/224 of ``image_size`` and centre-cropped to
``image_size`` square, normalised with ImageNet's mean and deviation, and run
in ``channels_last`` layout. Each output is the top five ImageNet classes with
their probabilities, and says where the weights came from.

The weights are a ``state_dict`` file in the version's folder (parameter
``weights``, for example torchvision's ``resnet50-11ad3fa6.pth``; an absolute
path, or ``FERRY_<MODEL>_WEIGHTS``, may point elsewhere). Random weights are
used only when ``random_weights`` asks for them (benchmarks), and then every
output says ``"weights": "random"``.
"""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from backends.base import RuntimeOptions, autocast, calibrated, parameter_problems
from backends.torch_runtime import PinnedStager, TorchRuntime
from core.models.repository import ModelConfig, ModelVersion, Problem

# Activations per input pixel, a deliberate over-estimate (about 100 MB per
# 224 x 224 image in fp32) used where peak memory cannot be measured.
DECLARED_BYTES_PER_PIXEL = 2048
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


PARAMETERS: dict[str, type | tuple[type, ...]] = {
    "architecture": str,
    "weights": str,
    "random_weights": bool,
    "decode_threads": int,
    "top_k": int,
}


class TorchvisionBackend:
    name = "torchvision"
    input_kinds = frozenset({"image"})
    uses_device = True

    def check(self, model: ModelConfig, version: ModelVersion) -> list[Problem]:
        problems = parameter_problems(model, PARAMETERS)
        threads, top_k = model.parameters.get("decode_threads", 4), model.parameters.get("top_k", 5)
        for key, value, low, high in (
            ("decode_threads", threads, 1, 64),
            ("top_k", top_k, 1, 1000),
        ):
            if isinstance(value, int) and not low <= value <= high:
                problems.append(
                    Problem(model.where(), f"parameters.{key}", f"must be {low} to {high}")
                )
        if model.parameters.get("random_weights"):
            return problems
        weights = model.parameter_path("weights", version.number)
        if weights is None:
            problems.append(
                Problem(
                    model.where(),
                    "parameters.weights",
                    "is missing: a state_dict file (or random_weights = true, for benchmarks)",
                )
            )
        elif not weights.is_file():
            problems.append(
                Problem(
                    model.where(version.folder),
                    "",
                    f"{weights.name} is missing (parameters.weights; "
                    f"{_env_hint(model)} may point elsewhere)",
                )
            )
        return problems

    def runtime(
        self, model: ModelConfig, version: ModelVersion, options: RuntimeOptions
    ) -> TorchvisionRuntime:
        p = model.parameters
        random_weights = bool(p.get("random_weights", False))
        return TorchvisionRuntime(
            name=model.name,
            options=options,
            architecture=str(p.get("architecture", "resnet50")),
            weights=None if random_weights else model.parameter_path("weights", version.number),
            random_weights=random_weights,
            image_size=model.input.image_size,
            decode_threads=int(p.get("decode_threads", 4)),
            top_k=int(p.get("top_k", 5)),
        )


def _env_hint(model: ModelConfig) -> str:
    from core.models.repository import env_name

    return env_name(model.name, "weights")


BACKENDS = {"torchvision": TorchvisionBackend()}


class TorchvisionRuntime(TorchRuntime):
    padded = False  # every image is resized to the same shape

    def __init__(
        self,
        name: str,
        options: RuntimeOptions,
        architecture: str,
        weights: Path | None,
        random_weights: bool = False,
        image_size: int = 224,
        decode_threads: int = 4,
        top_k: int = 5,
    ) -> None:
        if weights is None and not random_weights:
            raise ValueError(
                f"{name} needs weights: a state_dict file (parameters.weights, or "
                f"FERRY_{name.upper()}_WEIGHTS), or random_weights for a benchmark"
            )
        super().__init__(options)
        self.name = name
        self.architecture = architecture
        self.weights = weights
        self.weights_kind = "file" if weights is not None else "random"
        self.image_size = image_size
        self.top_k = top_k
        self._pool = ThreadPoolExecutor(decode_threads, thread_name_prefix=f"{name}-decode")

    def load(self) -> None:
        import torch

        self._take_device()
        if self.weights is None:
            torch.manual_seed(0)  # the same random network in every process
        model = build_network(self.architecture)
        if self.weights is not None:
            state = torch.load(self.weights, map_location="cpu", weights_only=True)
            try:
                result = model.load_state_dict(state, strict=False)
            except RuntimeError as exc:  # tensors of the wrong shapes
                raise ValueError(
                    f"{self.weights} is not a {self.architecture} state_dict: {exc}"
                ) from exc
            # Older files lack the batch norms' counters, which inference never reads.
            missing = [k for k in result.missing_keys if not k.endswith("num_batches_tracked")]
            if missing or result.unexpected_keys:
                raise ValueError(
                    f"{self.weights} is not a {self.architecture} state_dict "
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
        large_items = 4
        return calibrated(
            self.run, [blank], self.cost, [blank] * large_items, large_items * self.cost
        )

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
        scores, classes = probabilities.topk(min(self.top_k, probabilities.shape[1]), dim=1)
        return [
            {
                f"top{self.top_k}": [
                    {"class": int(c), "score": round(float(s), 6)}
                    for c, s in zip(row_classes.tolist(), row_scores.tolist(), strict=True)
                ],
                "weights": self.weights_kind,
            }
            for row_classes, row_scores in zip(classes, scores, strict=True)
        ]


def build_network(architecture: str) -> Any:
    """torchvision's ``architecture``, untrained; ResNet-50 (v1.5) is built here without it."""
    try:
        from torchvision.models import get_model

        return get_model(architecture, weights=None)
    except Exception as exc:  # not installed, or a build that does not match this torch
        if architecture == "resnet50":
            return _resnet50()
        raise ValueError(f"torchvision cannot build {architecture!r} here ({exc})") from exc


def build_resnet50() -> Any:
    """torchvision's ResNet-50 (v1.5: the stride in the 3 x 3 convolution), untrained."""
    return build_network("resnet50")


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
