"""Exercises of notebook 08 (fewer bytes per token): checks and reference solutions.

Checks run on small CPU tensors and shipped configs, so they print the same thing on every
machine.
"""

from __future__ import annotations

import torch

from kvlib.config import load_config
from kvlib.quant_cache import kv_format_bytes

from .checking import attempt, check, expect, hint

# --- 1. the ring's slot index ---------------------------------------------------------------


def slot_solution(p: int, window: int, sinks: int) -> int:
    """The slot of position ``p``: the first ``sinks`` positions keep their own slots, every later
    one goes round a ring of ``window`` slots after them."""
    return p if p < sinks else sinks + (p - sinks) % window


SLOT_CASES = [(4, 0), (4, 2), (5, 1), (1, 3)]  # (window, sinks)


@check
def check_slot(fn) -> None:
    """``fn(p, window, sinks)`` for positions well past the window, as the ring places them."""
    for window, sinks in SLOT_CASES:
        for p in range(3 * (window + sinks) + 2):
            got, want = attempt(fn, p, window, sinks), slot_solution(p, window, sinks)
            known = {p % window: "Only the positions after the sinks go round the ring: the sinks "
                                 "keep slots 0..sinks-1 and the ring starts at slot `sinks`.",
                     (p - sinks) % window: "The ring's slots come after the sinks' own: add "
                                           "`sinks`.",
                     p % (window + sinks): "A sink is never overwritten: the ring turns over "
                                           "`window` slots, not `window + sinks`."}
            expect(got == want, f"slot(p={p}, window={window}, sinks={sinks}): you said {got}, "
                                f"the ring puts it in slot {want}.", hint(got, known))


# --- 2. quantize to int8, per token ---------------------------------------------------------


def quantize_solution(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> int8 codes ``[..., D]`` and one scale per row ``[..., 1]``, symmetric:
    ``scale = max|x| / 127``, ``code = round(x / scale)``, so ``code * scale`` is within half a
    step of ``x``."""
    scale = (x.abs().amax(-1, keepdim=True) / 127).clamp_min(torch.finfo(x.dtype).tiny)
    return (x / scale).round().clamp(-127, 127).to(torch.int8), scale


def _rows() -> torch.Tensor:
    """``[4, 6, 16]`` rows of very different sizes, an outlier channel and an all-zero row."""
    x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(8))
    x = x * torch.logspace(-3, 1, 6).view(1, 6, 1)  # rows from 1e-3 to 10
    x[..., 5] *= 8
    x[1, 2] = 0
    return x


@check
def check_quantize(fn) -> None:
    """``fn(x)`` -> ``(code, scale)``: int8 codes in -127..127, a scale per row, and every
    ``code * scale`` within half of that row's step ``max|x| / 127`` of ``x``."""
    x = _rows()
    out = attempt(fn, x.clone())
    expect(isinstance(out, tuple) and len(out) == 2,
           f"return (code, scale), not {type(out).__name__}")
    code, scale = out
    expect(code.dtype == torch.int8 and tuple(code.shape) == tuple(x.shape),
           f"code: {code.dtype} {tuple(code.shape)}, want torch.int8 {tuple(x.shape)}")
    expect(tuple(scale.shape) == (*x.shape[:-1], 1),
           f"scale: shape {tuple(scale.shape)}, want {(*x.shape[:-1], 1)}: one per row (token and "
           f"head), kept as a last axis of 1 so that code * scale broadcasts")
    lo, hi = int(code.min()), int(code.max())
    expect(-127 <= lo and hi <= 127, f"codes span {lo}..{hi}, want -127..127: symmetric, and "
                                     f"-128 has no +128 to mirror it")
    back = code.float() * scale.float()
    expect(not back.isnan().any(), "code * scale has NaN: an all-zero row must not divide by 0")
    step = x.abs().amax(-1, keepdim=True) / 127  # each row's own step
    worst = ((x - back).abs() / step.clamp_min(1e-30)).nan_to_num().amax()
    expect(bool(worst <= 0.5 + 1e-3),
           f"code * scale is up to {worst:.2f} of a row's step max|x|/127 away from x, want "
           f"<= 0.5: round to the nearest code, with each row's own scale")


# --- 3. bytes per token, scales included ----------------------------------------------------


def int8_bytes_solution(config) -> int:
    """K and V, every layer and KV head: ``head_dim`` int8 codes and one 2-byte (bf16) scale."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * (head_dim + 2)


BYTES_CONFIGS = ["qwen3-4b", "smollm2-135m", "llama-3.2-3b"]


@check
def check_int8_bytes(fn) -> None:
    """``fn(config)`` -> int8 KV bytes per token with bf16 scales, as ``QuantCache`` holds."""
    for name in BYTES_CONFIGS:
        config = load_config(name)
        got, want = attempt(fn, config), kv_format_bytes(config, "int8")
        layers, kv = config.num_hidden_layers, config.num_key_value_heads
        q = config.num_attention_heads
        known = {want - 2 * layers * kv * 2: "You left the scales out: one 2-byte scale per "
                                             "token, layer, KV head, for K and for V.",
                 want // 2: "K and V: two tensors per layer.",
                 want * q // kv: "Only the KV heads are stored; the query heads share them."}
        expect(got == want, f"{name}: you said {got} B per token, int8 with bf16 scales is "
                            f"{want:,} B.", hint(got, known))
