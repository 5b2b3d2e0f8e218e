"""resnet50 inputs: base64 JPEG or PNG, checked from the header without decoding."""

from __future__ import annotations

import base64
import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from core.models.catalog import InputError
from core.models.inputs import ImageSpec
from core.models.repository import CostConfig

PIXELS = CostConfig("pixels")

SPEC = ImageSpec(image_size=224, max_image_bytes=64 * 1024, max_pixels=640 * 480, cost=PIXELS)


def encoded(size: tuple[int, int] = (32, 24), fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buffer, format=fmt)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_jpeg_or_png_costs_its_pixels_after_the_resize(fmt: str) -> None:
    image = encoded(fmt=fmt)
    checked = SPEC.validate(image)
    assert checked.input == image
    assert checked.cost == 224 * 224


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (123, "must be a base64 string, got number"),
        ({"image": "x"}, "must be a base64 string, got object"),
        ("not base64!!", "is not valid base64"),
        ("QUJD", "must be a JPEG or PNG image"),  # "ABC"
        (encoded(fmt="GIF"), "must be a JPEG or PNG image"),
        (base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 20).decode(), "not a readable"),
        (encoded(size=(800, 600)), "is 800 x 600 pixels; the limit is 307200 pixels"),
        ("A" * (4 * 64 * 1024), "is larger than 65536 bytes of image"),
    ],
)
def test_refused_inputs_say_why(value: Any, message: str) -> None:
    with pytest.raises(InputError) as refused:
        SPEC.validate(value)
    assert refused.value.field == "input"
    assert message in refused.value.message


def test_the_check_does_not_import_torch() -> None:
    code = (
        "import sys, core.models.inputs as c; from core.models.repository import CostConfig; "
        "spec = c.ImageSpec(image_size=224, max_image_bytes=65536, max_pixels=10**6, "
        "cost=CostConfig('pixels')); "
        f"assert spec.validate({encoded()!r}).cost == 224 * 224; "
        "loaded = [m for m in ('torch', 'torchvision') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def png_header(width: int, height: int) -> str:
    """A PNG with a header and no pixels: what the check reads."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    rest = chunk(b"IDAT", b"") + chunk(b"IEND", b"")
    return base64.b64encode(b"\x89PNG\r\n\x1a\n" + header + rest).decode()


def test_a_header_past_pillows_bomb_warning_is_a_422_not_a_500() -> None:
    # 100 M pixels: Pillow warns (warnings are errors in the tests); the limit answers.
    spec = ImageSpec(image_size=224, max_image_bytes=64 * 1024, max_pixels=40_000_000, cost=PIXELS)
    with pytest.raises(InputError, match="is 10000 x 10000 pixels"):
        spec.validate(png_header(10_000, 10_000))
