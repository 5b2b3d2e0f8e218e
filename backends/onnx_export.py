"""A saved SentenceTransformer folder as one ONNX graph the ``onnx`` backend runs.

The graph is the encoder, the folder's pooling (mean, CLS or max over the
attention mask) and, when the folder has a Normalize module, L2
normalisation: inputs ``input_ids``, ``attention_mask`` and (when the encoder
takes them) ``token_type_ids``, int64, both axes dynamic; one output,
``sentence_embedding``. The folder's tokenizer.json is copied beside it, so
DEST is a version folder as it stands::

    python -m backends.onnx_export SRC DEST [--opset 17]

and a model.toml with ``backend = "onnx"``, text input and
``tokenizer = "tokenizer.json"`` serves it.

PyTorch's TorchScript-based exporter (``dynamo=False``) is used: the
torch.export-based one needs onnxscript, which Ferry does not install.
"""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from backends.sentence_transformers import Layout, read_layout

DEFAULT_OPSET = 17  # the first with LayerNormalization as one operator
OUTPUT = "sentence_embedding"


def export(source: Path, dest: Path, opset: int = DEFAULT_OPSET) -> Path:
    """Write ``dest/model.onnx`` and ``dest/tokenizer.json`` from ``source``; the graph's path."""
    # The weights are on disk; never let a library reach for a hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    import transformers
    from transformers import AutoModel

    layout = read_layout(Path(source))
    tokenizer = layout.transformer / "tokenizer.json"
    if not tokenizer.is_file():
        raise ValueError(f"{tokenizer.name} is missing from the encoder's folder")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    encoder = AutoModel.from_pretrained(str(layout.transformer), local_files_only=True)
    encoder = encoder.float().eval()
    takes_types = "token_type_ids" in inspect.signature(encoder.forward).parameters
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if takes_types else [])
    module = pooled_module(encoder, layout, takes_types)
    # Traced on a padded batch of two lengths, so the mask's path through
    # the graph is the one real batches take.
    ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 102], [101, 7592, 102, 0, 0, 0]])
    mask = (ids != 0).long()
    example = (ids, mask, torch.zeros_like(ids)) if takes_types else (ids, mask)
    dynamic = {name: {0: "batch", 1: "sequence"} for name in names}
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    graph = dest / "model.onnx"
    with warnings.catch_warnings(), torch.no_grad():
        # The legacy exporter says it is legacy; the tracer flags shape checks
        # in transformers' masking code, which hold for every batch (the
        # graph is checked against PyTorch on padded batches in the tests).
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", message="Exporting aten::index", category=UserWarning)
        torch.onnx.export(
            module,
            example,
            str(graph),
            input_names=names,
            output_names=[OUTPUT],
            dynamic_axes={**dynamic, OUTPUT: {0: "batch"}},
            opset_version=opset,
            do_constant_folding=True,
            dynamo=False,
        )
    shutil.copyfile(tokenizer, dest / "tokenizer.json")
    return graph


def pooled_module(encoder: Any, layout: Layout, takes_types: bool) -> Any:
    """The encoder, the folder's pooling and normalisation as one ``torch.nn.Module``."""
    import torch

    class Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, ids: Any, mask: Any, types: Any = None) -> Any:
            extra = {"token_type_ids": types} if takes_types else {}
            hidden = self.encoder(input_ids=ids, attention_mask=mask, **extra)[0]
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            if layout.pooling == "cls":
                pooled = hidden[:, 0]
            elif layout.pooling == "max":
                pooled = hidden.masked_fill(weights == 0, -1e9).max(dim=1).values
            else:
                pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
            if not layout.normalize:
                return pooled
            return torch.nn.functional.normalize(pooled, p=2, dim=1)

    return Pooled()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, metavar="SRC", help="a saved SentenceTransformer")
    parser.add_argument("dest", type=Path, metavar="DEST", help="the folder to write")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET)
    args = parser.parse_args(argv)
    try:
        graph = export(args.source, args.dest, args.opset)
    except ValueError as exc:
        parser.exit(2, f"{parser.prog}: {args.source}: {exc}\n")
    size = graph.stat().st_size / 2**20
    print(f"wrote {graph} ({size:.1f} MiB) and {args.dest / 'tokenizer.json'}")
    # sentence-transformers truncates at the folder's max_seq_length: so must the model.
    max_tokens = read_layout(args.source).max_seq_length or 512
    print(
        "\nA model.toml for it (DEST as a version folder beside it):\n\n"
        'name = "..."\nbackend = "onnx"\n\n[input]\nkind = "text"\n'
        f'max_tokens = {max_tokens}\ntokenizer = "tokenizer.json"\n\n'
        '[cost]\nfunction = "tokens"'
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
