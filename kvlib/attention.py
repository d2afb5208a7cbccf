"""The static step's attention: a folded query ``[H, g, D]`` (H KV heads, g query heads each) over
a cache's ``[1, H, S, D]``, masked past the position. A masked SDPA call lands on the memory-
efficient kernel: one block per KV head, a few blocks for a card of a hundred SMs. Split-KV (flash-
decoding) cuts the span into P chunks: each chunk's log-sum-exp and normalised output, combined by
their softmax, so a decode step fills the card."""

import functools
import os

import torch
import torch.nn.functional as F

__all__ = ["HIDDEN", "MODES", "attend", "split_kv", "splits"]

MODES = ("split", "sdpa")  # split-KV; today's masked SDPA (memory-efficient on CUDA, no cuDNN)
HIDDEN = torch.finfo(torch.float32).min  # finite: a chunk masked whole gives no NaN
MIN_CHUNK, META_SMS = 64, 132  # slots per chunk at least; ``meta`` counts as the course's H200


@functools.cache
def splits(span: int, kv_heads: int, device: torch.device) -> int:
    """P: the largest divisor of ``span`` up to two blocks (KV head x chunk) per SM (a CPU core
    off CUDA), in chunks of ``MIN_CHUNK`` slots or more."""
    units = {"cuda": lambda: torch.cuda.get_device_properties(device).multi_processor_count,
             "meta": lambda: META_SMS}.get(device.type, lambda: os.cpu_count() or 1)()
    want = min(-(-2 * units // kv_heads), max(1, span // MIN_CHUNK))
    return max(p for p in range(1, want + 1) if span % p == 0)


def _bmm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # fp32 out: one kernel on CUDA
    if a.dtype == torch.float32 or a.device.type not in ("cuda", "meta"):
        return torch.bmm(a.float(), b.float())
    return torch.bmm(a, b, out_dtype=torch.float32)


def split_kv(q, keys, values, mask: torch.Tensor, scale: float, P: int) -> torch.Tensor:
    """``[H, g, D]``: softmax(scale q K^T + mask) V in P chunks; ``mask`` ``[S]`` fp32 (0 or
    ``HIDDEN``). Per chunk, ``log_softmax`` gives the scores less the chunk's log-sum-exp (its max
    plus the log of its sum of exponentials); its exponentials times the chunk's values are its
    normalised output. Scores and sums in fp32; the weights meet the values in their dtype."""
    H, g, D = q.shape
    if P < 1 or keys.shape[2] % P:
        raise ValueError(f"split_kv cuts the span into P equal chunks: P={P} does not divide the "
                         f"{keys.shape[2]} slots (splits() gives a divisor)")
    C = keys.shape[2] // P
    # slot-major scores [H, S, g]: a chunk's weights are then one batch's [g, C] (transposed)
    s = torch.add(mask.view(-1, 1), _bmm32(keys[0], q.transpose(1, 2)), alpha=scale)
    s = s.view(H, P, C, g)
    logp = s.log_softmax(2)
    lse = s[:, :, 0] - logp[:, :, 0]  # [H, P, g]; a chunk's slot 0 is hidden only if all of it is
    w = torch.exp(logp, out=torch.empty(logp.shape, dtype=values.dtype, device=q.device))
    # values [H * P, C, D]: a view if the span is the whole cache, else a copy (heads max_seq apart)
    o = _bmm32(w.view(H * P, C, g).transpose(1, 2), values[0].reshape(H * P, C, D))
    return torch.sum(o.view(H, P, g, D) * lse.softmax(1).unsqueeze(-1), 1,
                     out=torch.empty(H, g, D, dtype=q.dtype, device=q.device))


def attend(mode, pos: torch.Tensor, span: int, P: int, dtype: torch.dtype):
    """One step's ``(q, keys, values, scale) -> [H, g, D]`` at the device position ``pos``, its
    mask built here once for all layers. ``mode``: one of ``MODES``, or ``f(q, keys, values, scale,
    pos)`` of your own (the GPU check's cuDNN and FlexAttention)."""
    if callable(mode):
        return functools.partial(mode, pos=pos)
    if mode not in MODES:
        raise ValueError(f"attention must be one of {MODES} or a function, not {mode!r}")
    hidden = torch.arange(span, device=pos.device) > pos
    if mode == "split":
        mask = torch.zeros(span, device=pos.device).masked_fill_(hidden, HIDDEN)
        return lambda q, k, v, scale: split_kv(q, k, v, mask, scale, P)
    mask = torch.zeros(1, span, dtype=dtype, device=pos.device).masked_fill_(hidden, -torch.inf)
    return lambda q, k, v, scale: F.scaled_dot_product_attention(q[None], k, v, attn_mask=mask,
                                                                 scale=scale)[0]
