"""A model of the kernel torch's CUDA dispatcher picks for an SDPA call, by the card's compute
capability (``sdp_utils.cpp``), and of what a fused kernel allocates. Nothing here runs a kernel:
the simulated card (:mod:`course.simulate`, through :class:`Kernels`) and the fake card
(``tests/fake_card.py``) route every SDPA call, and answer torch's chooser, by :func:`kernel_of`,
so that a CPU sees the branch, and the bytes, a card would get."""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.nn.attention.bias import CausalBias
from torch.overrides import TorchFunctionMode

__all__ = ["BACKEND", "SDPA", "Kernels", "fused_sdpa", "kernel_of", "sdpa_kernel"]

SDPA = (F.scaled_dot_product_attention, torch._fused_sdp_choice)  # the calls routed
BACKEND = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
           "math": SDPBackend.MATH}  # what torch's chooser answers for each kernel


def sdpa_kernel(sm: float, q: torch.Tensor, k: torch.Tensor, mask, enable_gqa: bool) -> str:
    """The kernel torch's CUDA dispatcher picks for this call by default: flash needs sm >= 8.0,
    fp16/bf16 and no mask, and takes grouped KV heads; memory-efficient needs sm >= 5.0 (bf16 from
    8.0) and takes a mask but not grouped KV heads; math takes anything."""
    grouped = enable_gqa and q.shape[-3] != k.shape[-3]
    if sm >= 8.0 and mask is None and q.dtype in (torch.float16, torch.bfloat16):
        return "flash"
    if not grouped and (sm >= 8.0 or (sm >= 5.0 and q.dtype != torch.bfloat16)):
        return "efficient"
    return "math"


def kernel_of(sm: float, args: tuple, kwargs: dict) -> tuple[str, torch.Tensor | None]:
    """The kernel one of :data:`SDPA`'s calls gets at ``sm``, and its mask tensor: None for a
    causal rule, which is no tensor (the kernel applies it)."""
    q, k = args[:2]
    mask = kwargs.get("attn_mask")
    mask = None if isinstance(mask, CausalBias) else mask
    return sdpa_kernel(sm, q, k, mask, kwargs.get("enable_gqa", False)), mask


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
        if func not in SDPA:
            return func(*args, **kwargs)
        kind, mask = kernel_of(self.sm, args, kwargs)
        kind = "math" if self.attention == "math" else kind
        if func is torch._fused_sdp_choice:  # the decoder asks which kernel a call would get
            return int(BACKEND[kind])
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if mask is not None:
            self.ledger.relabel(mask, "mask")
        with self.ledger.region("attention"):
            return func(*args, **kwargs) if kind == "math" else fused_sdpa(args[0], args[2], mask)
