"""Paged attention for step-level batching, plugged into the library's own model code.

A step runs every scheduled sequence's new tokens through the model at once,
packed along one axis (batch 1, ``T`` tokens): a decoding sequence adds one
token, a prefilling one a chunk of its prompt. Everything but attention is
the library's code (embeddings, rotary positions, norms, MLPs, the head);
attention is registered with ``transformers.AttentionInterface`` under
:data:`ATTENTION`, the way vLLM's Transformers backend plugs its kernels in.
The attention function writes each token's key and value into its
sequence's blocks of the :class:`KVPool`, then attends each sequence to its
own keys only, through the library's SDPA function on that sequence's slice,
so a sequence computes the same attention as when the library runs it alone.

Keys and values of one layer live in one tensor of ``blocks x block_size``
slots; a sequence owns whole blocks (its block table, given by the
scheduler), so its memory is reserved in blocks and freed by dropping the
table, without copying anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

ATTENTION = "ferry_paged"
# The keyword the step's layout travels under, from the model's forward to the attention function.
STEP_KWARG = "ferry_step"


@dataclass(frozen=True)
class KVShape:
    """What one token's keys and values take in every layer."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, config: Any, dtype: torch.dtype) -> KVShape:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers, kv_heads, head_dim, dtype)

    @property
    def bytes_per_token(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.head_dim * element


class KVPool:
    """Keys and values of every layer, ``blocks x block_size`` token slots each.

    Slot ``b * block_size + i`` is position ``i`` of block ``b``. The pool is
    allocated once at load, so its bytes are the KV budget and nothing grows
    during a run.
    """

    def __init__(self, shape: KVShape, blocks: int, block_size: int, device: str) -> None:
        self.shape = shape
        self.blocks = blocks
        self.block_size = block_size
        slots = blocks * block_size
        size = (slots, shape.kv_heads, shape.head_dim)
        self.keys = [
            torch.zeros(size, dtype=shape.dtype, device=device) for _ in range(shape.layers)
        ]
        self.values = [
            torch.zeros(size, dtype=shape.dtype, device=device) for _ in range(shape.layers)
        ]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def slots(self, table: torch.Tensor, length: int) -> torch.Tensor:
        """The slots of positions ``0 .. length - 1`` of a sequence whose blocks are ``table``."""
        positions = torch.arange(length, device=table.device)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size


@dataclass(frozen=True)
class Segment:
    """One sequence's tokens in a packed step.

    ``offset``/``length``: where its new tokens sit on the packed axis.
    ``start``: the position of its first new token (the tokens before are
    in its blocks already). ``slots``: the slots of positions ``0 .. start +
    length - 1``, the new ones last.
    """

    offset: int
    length: int
    start: int
    slots: torch.Tensor


@dataclass(frozen=True)
class Decodes:
    """The step's decoding sequences, attended together: one token each, last on the axis.

    ``offset``: where the first of them sits on the packed axis (they run to
    its end). ``slots``: ``(n, longest)``, each row a sequence's slots,
    padded with slot 0; ``mask``: ``(n, 1, 1, longest)``, True where a row's
    slot is its own.
    """

    offset: int
    slots: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def of(cls, offset: int, rows: list[torch.Tensor]) -> Decodes:
        longest = max(len(row) for row in rows)
        slots = torch.zeros((len(rows), longest), dtype=torch.long, device=rows[0].device)
        mask = torch.zeros((len(rows), longest), dtype=torch.bool, device=rows[0].device)
        for i, row in enumerate(rows):
            slots[i, : len(row)] = row
            mask[i, : len(row)] = True
        return cls(offset, slots, mask[:, None, None, :])


@dataclass(frozen=True)
class StepLayout:
    """A packed step: every sequence's segment, and the slots its new tokens write.

    ``decodes``: when set, the decoding sequences (the segments from its
    offset on) are attended in one call instead of one call each.
    """

    pool: KVPool
    segments: tuple[Segment, ...]
    write_slots: torch.Tensor  # one per packed token, in packed order
    decodes: Decodes | None = None


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Write the step's keys and values into the pool, then attend each sequence to its own.

    ``query`` is ``(1, heads, T, d)``, ``key`` and ``value`` ``(1, kv_heads,
    T, d)`` for the ``T`` packed tokens. Returns ``(1, T, heads, d)``, as the
    library's attention functions do.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout: StepLayout = kwargs[STEP_KWARG]
    layer: int = module.layer_idx  # type: ignore[assignment]
    pool = layout.pool
    keys, values = pool.keys[layer], pool.values[layer]
    keys.index_copy_(0, layout.write_slots, key[0].transpose(0, 1).to(keys.dtype))
    values.index_copy_(0, layout.write_slots, value[0].transpose(0, 1).to(values.dtype))
    outputs = []
    decodes = layout.decodes
    for segment in layout.segments:
        if decodes is not None and segment.offset >= decodes.offset:
            break
        q = query[:, :, segment.offset : segment.offset + segment.length]
        k = keys.index_select(0, segment.slots).transpose(0, 1).unsqueeze(0).to(query.dtype)
        v = values.index_select(0, segment.slots).transpose(0, 1).unsqueeze(0).to(query.dtype)
        mask = None
        if segment.start > 0 and segment.length > 1:
            # A later chunk of a prompt: its tokens see every earlier position and
            # the chunk's own causally (sdpa's is_causal aligns to the top left).
            total = segment.start + segment.length
            rows = torch.arange(segment.start, total, device=query.device)[:, None]
            mask = (torch.arange(total, device=query.device)[None, :] <= rows)[None, None]
        out, _ = sdpa_attention_forward(
            module, q, k, v, mask, dropout=0.0, scaling=scaling, is_causal=mask is None
        )
        outputs.append(out)
    if decodes is not None:
        # (n, heads, 1, d) queries against (n, kv_heads, longest, d) padded keys.
        q = query[0, :, decodes.offset :].transpose(0, 1).unsqueeze(2)
        k = keys[decodes.slots].transpose(1, 2).to(query.dtype)
        v = values[decodes.slots].transpose(1, 2).to(query.dtype)
        out, _ = sdpa_attention_forward(
            module, q, k, v, decodes.mask, dropout=0.0, scaling=scaling, is_causal=False
        )
        outputs.append(out.transpose(0, 1))  # (n, 1, heads, d) -> (1, n, heads, d)
    return torch.cat(outputs, dim=1), None


def no_mask(*args: Any, **kwargs: Any) -> None:
    """The library builds no mask for this attention: each segment makes its own."""
    return None


_registered = False


def register() -> None:
    """Register :data:`ATTENTION` with the library (once per process)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, paged_attention)
    AttentionMaskInterface.register(ATTENTION, no_mask)
    _registered = True
