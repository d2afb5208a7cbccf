"""The memory budget, computed before anything runs: weights, KV per token and a forward's
workspace (which grows with the context too) follow from the config, so the longest context with
``weights + kv_bytes_per_token * context + workspace(context) <= budget`` is known in advance."""

from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from functools import partial

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from .config import GIB, MIB, head_dim, kv_bytes, kv_bytes_per_token, kv_heads, load_config

__all__ = ["ATTENTION", "Budget", "WindowBudget", "graph_pool_bytes", "largest", "meta_model",
           "param_count", "plan_budget", "plan_kv", "run_workspace", "weight_bytes",
           "workspace_bytes", "workspace_phases"]

FAMILIES = ("llama", "qwen2", "qwen3")  # the families param_count can count


def param_count(config: PretrainedConfig) -> int:
    """Parameters of a Llama / Qwen2 / Qwen3 causal LM by arithmetic on the config (Qwen2 always
    biases q/k/v; ``attention_bias`` all four; Qwen3 adds ``q_norm``/``k_norm``)."""
    kind = config.model_type
    if kind not in FAMILIES:
        raise ValueError(f"param_count knows {FAMILIES}, not model_type={kind!r}")
    h, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    hd = head_dim(config)
    q, kv = config.num_attention_heads * hd, kv_heads(config) * hd
    attn = 2 * h * q + 2 * h * kv  # q, o: h<->q;  k, v: h->kv
    if kind == "qwen2":
        attn += q + 2 * kv
    elif getattr(config, "attention_bias", False):
        attn += q + 2 * kv + h
    if kind == "qwen3":
        attn += 2 * hd
    mlp = 3 * h * inter + (2 * inter + h if getattr(config, "mlp_bias", False) else 0)
    head = 0 if config.tie_word_embeddings else vocab * h
    return vocab * h + config.num_hidden_layers * (attn + mlp + 2 * h) + h + head


def weight_bytes(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """Bytes of the weights in ``dtype`` (tied embeddings stored once)."""
    return param_count(config) * dtype.itemsize


def meta_model(config: PretrainedConfig | str, dtype: torch.dtype = torch.bfloat16):
    """The real ``transformers`` model of a config (or a shipped one's name) built on ``meta``: the
    full architecture, shapes without memory. A model passes through as it is."""
    if isinstance(config, torch.nn.Module):
        return config
    config = load_config(config) if isinstance(config, str) else config
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


ATTENTION = ("fused", "math")  # the kernels a plan prices: fused (flash, memory-efficient) or math


def workspace_phases(config: PretrainedConfig, dtype: torch.dtype, tokens: int = 1, *,
                     attention: str = "fused", cache: str = "prealloc",
                     batch: int = 1) -> dict[str, tuple[int, int]]:
    """Transient bytes of each phase of kvlib's forward that can peak: ``(fixed, per token)``, for
    ``batch`` requests of n = ``tokens`` each after S cached ones (per token: of one's S).

    All forward long (``base``): the residual and its norm, RoPE's cos and sin, positions and ids
    (int64), the last logits; and, where no fused kernel takes the causal rule itself (math; fp32
    with grouped heads), each request's mask ``[group * n, S]`` (``held``), built once for all
    layers. On top, one phase at a time: the tensors its comment below names."""
    if attention not in ATTENTION or cache not in ("prealloc", "cat"):
        raise ValueError(f"attention must be one of {ATTENTION} and cache prealloc or cat, "
                         f"got {attention!r}, {cache!r}")
    e, n, B, d, V = dtype.itemsize, tokens, batch, config.hidden_size, config.vocab_size
    Hq, Hkv, D = config.num_attention_heads, kv_heads(config), head_dim(config)
    g = Hq // Hkv
    masked = attention == "math" or (g > 1 and dtype not in (torch.float16, torch.bfloat16))
    held = B * n * g * e if masked else 0  # per token of context: every request's mask
    base = B * n * (2 * d * e + 2 * D * e + 16) + B * V * e
    out, qkv = n * Hq * D * e, B * n * (Hq + 2 * Hkv) * D * e  # out: one request's [n, Hq, D]
    phases = {"mlp": (base + 3 * B * n * config.intermediate_size * e, held),  # gate, up, product
              "logits": (base + B * V * (e + 4 if e < 4 else e), held)}  # and an fp32 copy
    if config.model_type == "qwen3":  # q_norm: fp32 q (unless it is), product, mean square, rsqrt
        phases["norm"] = (base + qkv + B * n * Hq * (D * (8 if e < 4 else 4) + 8), held)
    qkv += (B - 1) * out  # from the attention on: + the earlier requests' outputs
    if masked:  # while one is built: the visibility [n, S], zeros, their masked copy
        phases["mask"] = (B * V * e, held - n * g * e + n * (1 + (2 + g) * e))
    if attention == "fused":  # + output, log-sum-exp; masked: the folded q, the mask padded by 8
        fold = (out + g * n * 8 * e, g * n * e) if masked else (0, 0)
        phases["attention"] = (base + qkv + out + n * Hq * 4 + fold[0], held + fold[1])
    else:  # + q folded, in fp32, scaled; K, V in fp32; scores, softmax; their -inf tests in bool
        fixed = base + qkv + out + 2 * n * Hq * D * 4 + 4  # + the scale, an fp32 scalar
        phases["attention"] = (fixed + n * Hq, held + 2 * Hkv * D * 4 + Hq * n * 9)
        phases["scores"] = (fixed, held + 3 * Hkv * D * 4 + Hq * n * 4)  # + K scaled: peaks decode
    if cache == "cat":  # the old V holds the S cached slots but not the n new ones
        phases["cat"] = (base + qkv - n * Hkv * D * e, held + Hkv * D * e)
        if "norm" in phases:  # before its write: the last layer's KV lacks the n new slots
            phases["norm"] = (phases["norm"][0] - B * n * 2 * Hkv * D * e, held)
    return phases


def workspace_bytes(config: PretrainedConfig, dtype: torch.dtype, tokens: int = 1,
                    batch: int = 1, *, context: int = 0, attention: str = "fused",
                    cache: str = "prealloc") -> int:
    """Transient bytes of one forward: the largest of :func:`workspace_phases` (never all live)."""
    phases = workspace_phases(config, dtype, tokens, attention=attention, cache=cache, batch=batch)
    return max(fixed + per_token * context for fixed, per_token in phases.values())


def run_workspace(config: PretrainedConfig, dtype: torch.dtype, context: int,
                  prefill_chunk: int = 512, batch: int = 1, *, attention: str = "fused",
                  cache: str = "prealloc") -> int:
    """What a run to ``context`` tokens holds at its peak beyond the weights and their KV: the
    worst of the last full chunk, a last partial one and a decode step (``cat``: less KV before)."""
    kv = kv_bytes_per_token(config, dtype, batch)
    full, worst = context // prefill_chunk * prefill_chunk, 0
    prompt = 8 * batch * context  # the prompt's ids (int64): the loop keeps them on the device
    for end, tokens in ((full, prefill_chunk), (context, context - full), (context, 1)):
        if end and tokens:
            cached = kv * (end if cache == "cat" else context)
            worst = max(worst, cached + workspace_bytes(config, dtype, tokens, batch, context=end,
                                                        attention=attention, cache=cache))
    return worst + prompt - kv * context


def graph_pool_bytes(config: PretrainedConfig, dtype: torch.dtype, context: int,
                     bucket: int = 256) -> int:
    """At most what graph mode's shared pool holds at ``context`` (split-KV): a step at the longest
    span, per slot its fp32 mask (with arange and bool) and a layer's fp32 scores (matmul, masked),
    log-softmax, weights in ``dtype``, V copied; each layer's RoPE matrix; each bucket's logits."""
    e, Hq, Hkv, D = dtype.itemsize, config.num_attention_heads, kv_heads(config), head_dim(config)
    rotations = config.num_hidden_layers * (Hq // Hkv + 1) * D * D * e
    logits = -(-context // bucket) * config.vocab_size * e
    return context * (13 + Hq * (12 + e) + Hkv * D * e) + rotations + logits


def largest(fits, hi: int, first: int | None = None, lo: int = 0) -> int:
    """The largest ``n < hi`` with ``fits(n)``, by bisection from ``lo`` (which fits, or is 0),
    ``hi`` not fitting; ``first`` (the plan) is tried first, so the search goes on around it. The
    one search for what fits a budget: the plan's own ``max_context``, and the simulated and the
    measured card's longest context, each tried from the plan."""
    n = first
    while hi - lo > 1:
        if n is None or not lo < n < hi:
            n = (lo + hi) // 2
        lo, hi, n = (n, hi, None) if fits(n) else (lo, n, None)
    return lo


@dataclass(frozen=True)
class Budget:
    """Fixed weights, KV per token, and ``workspace_at(context)``, under ``budget`` (what the
    allocator may hold); ``max_context`` and its ``workspace`` are computed once, for ``asdict``.
    A paged cache reserves KV in whole blocks of ``block`` tokens (1: exactly the tokens).
    ``kv_at(tokens)`` prices KV that stops growing (windowed layers): ``kv_per_token`` past it."""

    weights: int
    kv_per_token: int
    budget: int
    workspace_at: InitVar[Callable[[int], int] | None] = None
    block: int = 1
    kv_at: InitVar[Callable[[int], int] | None] = None
    max_context: int = field(init=False)
    workspace: int = field(init=False)

    def __post_init__(self, workspace_at, kv_at) -> None:
        object.__setattr__(self, "_workspace_at", workspace_at or (lambda context: 0))
        object.__setattr__(self, "_kv_at", kv_at or (lambda tokens: self.kv_per_token * tokens))
        hi = max(1, (self.budget - self.weights) // max(1, self.kv_per_token) + 1)  # the KV alone
        lo = largest(lambda n: self.breakdown(n)["free"] >= 0, hi)  # the workspace grows too
        object.__setattr__(self, "max_context", lo)
        object.__setattr__(self, "workspace", self._workspace_at(lo))

    def breakdown(self, context: int) -> dict[str, int]:
        """Bytes of each part at ``context`` tokens; ``free`` is negative past ``max_context``."""
        slots = -(-context // self.block) * self.block  # the last block is reserved whole
        kv, workspace = self._kv_at(slots), self._workspace_at(context)
        free = self.budget - self.weights - kv - workspace
        return {"weights": self.weights, "kv": kv, "workspace": workspace, "free": free}

    def __repr__(self) -> str:
        return (f"Budget({self.budget / GIB:.2f} GiB: weights {self.weights / GIB:.2f} GiB, "
                f"workspace {self.workspace / MIB:.1f} MiB, {self.kv_per_token / 1024:.0f} "
                f"KiB/token -> max_context={self.max_context:,})")


def plan_budget(config: PretrainedConfig, dtype: torch.dtype, budget_bytes: int, batch: int = 1,
                prefill_chunk: int = 512, *, attention: str = "fused", cache: str = "prealloc",
                block: int = 1, tp: int = 1, graph_bucket: int | None = None) -> Budget:
    """The :class:`Budget` of ``config`` in ``dtype`` for kvlib's token loop; ``attention``:
    ``"fused"`` (sm >= 8.0) or ``"math"``, where kernels fall back
    (:func:`kvlib.sdpa_choice.sdpa_kernel`).

    The guarantee: ``max_context`` runs on :mod:`course.simulate`'s card (live tensor bytes, op by
    op), ``batch`` requests of a prompt and its new tokens, at any ``prefill_chunk``; 1% more does
    not. It prices every tensor the loop holds: weights, RoPE's buffers, KV, the prompt's ids, each
    phase's activations, masks, the kernels' outputs and the math path's scores; a prompt of the
    whole context, so it may fall a few tokens short. Not priced: the allocator's rounding and
    cache, the CUDA context, libraries' workspaces. ``graph_bucket``: decode in graph mode with
    that bucket, whose pool (:func:`graph_pool_bytes`) is held on top.

    ``budget_bytes`` is one GPU's. With ``tp`` GPUs (tensor parallel) each holds ``1 / tp`` of the
    weights and of the KV heads, down to one head: a head cannot be split, so past ``Hkv`` GPUs
    heads are copied. The workspace is priced whole, an upper bound for a share of the heads."""
    Hq, Hkv = config.num_attention_heads, kv_heads(config)
    if budget_bytes <= 0 or min(batch, prefill_chunk, block, tp) < 1:
        raise ValueError(f"bad budget: budget_bytes={budget_bytes} batch={batch} "
                         f"prefill_chunk={prefill_chunk} block={block} tp={tp}")
    if Hq % tp or (Hkv % tp and tp % Hkv):
        raise ValueError(f"tp={tp} must divide the {Hq} query heads, and divide the {Hkv} KV "
                         f"heads or be a multiple of them")
    workspace_phases(config, dtype, attention=attention, cache=cache)  # refuse bad names now
    eager = partial(run_workspace, config, dtype, prefill_chunk=prefill_chunk, batch=batch,
                    attention=attention, cache=cache)
    pool = partial(graph_pool_bytes, config, dtype, bucket=graph_bucket or 1)
    workspace = (lambda n: eager(n) + pool(n)) if graph_bucket else eager
    rope = 4 * head_dim(config)  # RoPE's inverse frequencies: two fp32 buffers of D / 2
    share = max(1, Hkv // tp)  # the KV heads each GPU holds
    kv = kv_bytes_per_token(config, dtype, batch) * share // Hkv
    return Budget(weight_bytes(config, dtype) // tp + rope, kv, int(budget_bytes), workspace,
                  block, lambda n: kv_bytes(config, dtype, n, batch) * share // Hkv)


@dataclass(frozen=True, repr=False)
class WindowBudget(Budget):
    """At most ``window`` tokens of KV a sequence: if they fit, any context up to ``positions``."""

    window: int = 1
    positions: int = 1

    def __post_init__(self, workspace_at, kv_at) -> None:
        super().__post_init__(workspace_at, kv_at)
        fits = self.breakdown(self.window)["free"] >= 0
        object.__setattr__(self, "max_context", self.positions if fits else 0)

    def breakdown(self, context: int) -> dict[str, int]:
        return super().breakdown(min(context, self.window))


def plan_kv(config: PretrainedConfig, dtype: torch.dtype, budget_bytes: int, kv: str = "bf16",
            window: int | None = None, batch: int = 1) -> Budget:
    """:func:`plan_budget` with the KV stored as ``kv`` (a format of :data:`kvlib.config.FORMATS`,
    as a :class:`~kvlib.QuantCache` stores int8 and int4) and, given a ``window``, each sequence's
    KV capped at ``window`` tokens."""
    plan = plan_budget(config, dtype, budget_bytes, batch=batch)
    parts = (plan.weights, kv_bytes_per_token(config, kv, batch), plan.budget, plan._workspace_at)
    if window is None:
        return Budget(*parts)
    return WindowBudget(*parts, window=window, positions=config.max_position_embeddings)
