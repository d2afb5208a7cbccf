"""Named cards from the vendors' spec sheets, and the bandwidth floor of a decode step on each (the
kernel a card's SDPA calls get: :mod:`kvlib.sdpa_choice`, by ``Card.sm``).

Sheets write memory in "GB", but chips come in binary sizes, so ``memory`` reads the GB as GiB:
the ceiling. A GDDR card with ECC on stores its check bits in that memory and shows less of it (a
T4, ECC on by default: 15 of its 16 GiB); HBM keeps them aside. Bandwidth is decimal.
Compute capabilities: https://developer.nvidia.com/cuda-gpus."""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from .bandwidth import floor_s_per_token, step_bytes
from .config import GIB

__all__ = ["CARDS", "Card", "card"]


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
