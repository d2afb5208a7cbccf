"""Named cards from the vendors' spec sheets, and what follows from them: the attention kernel a
call runs, what it allocates on the simulated card, and the bandwidth floor of a decode step.

Sheets write memory in "GB", but chips come in binary sizes, so ``memory`` reads the GB as GiB:
the ceiling. A GDDR card with ECC on stores its check bits in that memory and shows less of it (a
T4, ECC on by default: 15 of its 16 GiB); HBM keeps them aside. Bandwidth is decimal.
Compute capabilities: https://developer.nvidia.com/cuda-gpus."""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.nn.attention.bias import CausalBias
from torch.overrides import TorchFunctionMode
from transformers import PretrainedConfig

from .bandwidth import floor_s_per_token, step_bytes
from .config import GIB

__all__ = ["CARDS", "Card", "Kernels", "card", "fused_sdpa", "sdpa_kernel"]


@dataclass(frozen=True)
class Card:
    """A GPU as the simulation and the bandwidth floor need it."""

    name: str
    memory_gb: float  # as the sheet says; ``memory`` is it in bytes, read as GiB
    sm: float  # compute capability: picks the attention kernels
    bandwidth: float  # bytes/s, decimal
    source: str
    ecc_share: float = 0.0  # of the memory held for ECC check bits, out of the programs' reach
    memory = property(lambda self: int(self.memory_gb * GIB * (1 - self.ecc_share)))  # bytes

    def predicted_ms_per_token(self, config: PretrainedConfig, dtype: torch.dtype, context: int,
                               cache: str = "prealloc") -> float:
        """A prediction, not a measurement: the bandwidth floor of a decode step at ``context``,
        in ms (:func:`kvlib.bandwidth.step_bytes` over the sheet's bandwidth)."""
        return 1e3 * floor_s_per_token(step_bytes(config, dtype, context, cache), self.bandwidth)


# The sheets' numbers, each with its page. "12 GiB" is no product: the course's budget
# (kvlib.memory's allocator cap) on the cheapest 12 GB card.
_SHEETS = json.loads((Path(__file__).parent / "cards.json").read_text())
CARDS = {c["name"]: Card(**c) for c in _SHEETS}


def card(name: str | Card) -> Card:
    """A card of :data:`CARDS` by name (a :class:`Card` passes through)."""
    if isinstance(name, Card):
        return name
    if name not in CARDS:
        raise ValueError(f"no card {name!r}; known: {', '.join(CARDS)}")
    return CARDS[name]


def sdpa_kernel(sm: float, q: torch.Tensor, k: torch.Tensor, mask, enable_gqa: bool) -> str:
    """The kernel torch's CUDA dispatcher picks for this call by default (``sdp_utils.cpp``):
    flash needs sm >= 8.0, fp16/bf16 and no mask, and takes grouped KV heads; memory-efficient needs
    sm >= 5.0 (bf16 from 8.0) and takes a mask but not grouped KV heads; math takes anything."""
    grouped = enable_gqa and q.shape[-3] != k.shape[-3]
    if sm >= 8.0 and mask is None and q.dtype in (torch.float16, torch.bfloat16):
        return "flash"
    if not grouped and (sm >= 8.0 or (sm >= 5.0 and q.dtype != torch.bfloat16)):
        return "efficient"
    return "math"


def fused_sdpa(q: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """What a fused kernel allocates: the output, an fp32 log-sum-exp, and the memory-efficient
    kernel's padded copy of a mask whose rows are not 8-aligned (torch's ``preprocess_mask``)."""
    B, H, n, _ = q.shape
    unaligned = mask is not None and any(s % 8 for s in mask.stride()[:-1])
    pad = F.pad(mask, (0, 8 - mask.shape[-1] % 8)) if unaligned else None
    out = q.new_empty(B, n, H, v.shape[-1]).transpose(1, 2)  # stored [B, n, Hq, D], as kernels do
    lse = q.new_empty(B, H, n, dtype=torch.float32)
    del pad, lse
    return out


_BACKEND = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}  # what torch's chooser answers


class Kernels(TorchFunctionMode):
    """Route each SDPA call as :func:`sdpa_kernel` at ``sm`` would (or to the math path), and
    answer torch's chooser so; the mask and the kernel's bytes go to regions of the ``ledger``;
    ``counts`` tallies the kernels."""

    def __init__(self, ledger, sm: float, attention: str = "auto") -> None:
        super().__init__()
        self.ledger, self.sm, self.attention = ledger, sm, attention
        self.counts: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in (F.scaled_dot_product_attention, torch._fused_sdp_choice):
            return func(*args, **kwargs)
        q, k, v = args[:3]
        mask = kwargs.get("attn_mask")  # a causal rule is no tensor: the kernel applies it
        mask = None if isinstance(mask, CausalBias) else mask
        kind = "math" if self.attention == "math" else sdpa_kernel(
            self.sm, q, k, mask, kwargs.get("enable_gqa", False))
        if func is torch._fused_sdp_choice:  # the decoder asks which kernel a call would get
            return int(_BACKEND[kind])
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if mask is not None:
            self.ledger.relabel(mask, "mask")
        with self.ledger.region("attention"):
            return func(*args, **kwargs) if kind == "math" else fused_sdpa(q, v, mask)
