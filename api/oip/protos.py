"""The Python modules of the inference protocol's gRPC service, generated from its .proto files.

The .proto files are Triton's published ones (``grpc_service.proto`` and the
``model_config.proto`` it imports), kept as they are in ``api/oip/third_party``
beside what protoc writes from them. protoc writes modules that import each
other as top-level modules; here they are rewritten to import from that
package. After changing a .proto file (or the pinned grpcio-tools):

    python -m api.oip.protos --write

``tests/unit/test_oip_grpc.py`` fails while the committed modules differ from
what this writes.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent / "third_party"
PROTOS = ("grpc_service.proto", "model_config.proto")
COMMAND = "python -m api.oip.protos --write"
# What protoc's gRPC plugin writes for a .proto without a service: nothing to import.
SERVICELESS = frozenset({"model_config_pb2_grpc.py"})
# protoc's imports of one generated module from another, in .py and .pyi.
_IMPORT = re.compile(r"^import (grpc_service_pb2|model_config_pb2) as ", re.M)


def generated() -> dict[str, str]:
    """Each generated module's name and text, its imports made package-relative."""
    from grpc_tools import protoc  # the dev extra's; only this script needs it

    with tempfile.TemporaryDirectory() as out:
        status = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{HERE}",
                f"--python_out={out}",
                f"--pyi_out={out}",
                f"--grpc_python_out={out}",
                *(str(HERE / name) for name in PROTOS),
            ]
        )
        if status != 0:
            raise RuntimeError(f"protoc failed (exit {status})")
        texts = {}
        for path in sorted(Path(out).iterdir()):
            if path.name in SERVICELESS:
                continue
            text = _IMPORT.sub(r"from api.oip.third_party import \1 as ", path.read_text())
            texts[path.name] = text
        return texts


def stale() -> list[str]:
    """The generated modules missing or different in this folder."""
    return [
        name
        for name, text in generated().items()
        if not (HERE / name).exists() or (HERE / name).read_text() != text
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the modules (else: check)")
    args = parser.parse_args(argv)
    if args.write:
        for name, text in generated().items():
            (HERE / name).write_text(text)
        return 0
    different = stale()
    if different:
        print(f"stale: {', '.join(different)}; run: {COMMAND}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
