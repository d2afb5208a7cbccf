"""The memory budget, computed before anything runs: weights, KV per token and a forward's
workspace (which grows with the context too) follow from the config, so the longest context with
``weights + kv_bytes_per_token * context + workspace(context) <= budget`` is known in advance.
"""

from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from functools import partial

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from .config import GIB, MIB, head_dim, kv_bytes_per_token, kv_heads, load_config
from .memory import largest

__all__ = ["ATTENTION", "Budget", "meta_model", "param_count", "plan_budget", "run_workspace",
           "weight_bytes", "workspace_bytes", "workspace_phases"]

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
    full architecture, shapes without memory."""
    config = load_config(config) if isinstance(config, str) else config
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


ATTENTION = ("fused", "math")  # the kernels a plan prices: fused (flash, memory-efficient) or math


def workspace_phases(config: PretrainedConfig, dtype: torch.dtype, tokens: int = 1, *,
                     attention: str = "fused",
                     cache: str = "prealloc") -> dict[str, tuple[int, int]]:
    """Transient bytes of each phase of kvlib's forward that can peak: ``(fixed, per token)``.

    A chunk of n = ``tokens`` after S cached ones holds, all forward long, the mask
    ``[group * n, S]`` built once for all layers, and small activations. On top, one at a time:
    ``mask`` (while it is built: the visibility ``[n, S]``, zeros and their masked copy);
    ``attention`` (fused: output, log-sum-exp and a padded mask copy; math: q, K, V in fp32, the
    scores and softmax ``[Hq, n, S]`` in fp32); ``decode`` (math: K and V upcast and copied per
    query head); ``cat`` (a layer's old K while the longer one is built); ``mlp`` (gate, up,
    product); ``logits`` (and an fp32 copy).
    """
    if attention not in ATTENTION or cache not in ("prealloc", "cat"):
        raise ValueError(f"attention must be one of {ATTENTION} and cache prealloc or cat, "
                         f"got {attention!r}, {cache!r}")
    e, n, d, V = dtype.itemsize, tokens, config.hidden_size, config.vocab_size
    Hq, Hkv, D = config.num_attention_heads, kv_heads(config), head_dim(config)
    g = Hq // Hkv
    held = n * g * e  # per token of context: the mask (the visibility is freed once it is built)
    act = n * e * (2 * d + 2 * Hq * D + 2 * Hkv * D) + V * e
    phases = {"mask": (V * e, n * (1 + (2 + g) * e)),
              "mlp": (act + 3 * n * config.intermediate_size * e, held),
              "logits": (act + V * (e + 4 if e < 4 else e), held)}
    if attention == "fused":  # + output, log-sum-exp, the mask padded by up to 8 columns
        phases["attention"] = (act + n * Hq * (D * e + 4) + g * n * 8 * e, held + g * n * e)
    else:  # + q (twice), K, V in fp32; scores and softmax in fp32, the -inf test in bool
        phases["attention"] = (act + 2 * n * Hq * D * 4, held + 2 * Hkv * D * 4 + Hq * n * 9)
        phases["decode"] = (V * e, (2 * Hkv + 3 * Hq) * D * 4)
    if cache == "cat":
        phases["cat"] = (act, held + Hkv * D * e)
    return phases


def workspace_bytes(config: PretrainedConfig, dtype: torch.dtype, tokens: int = 1,
                    batch: int = 1, *, context: int = 0, attention: str = "fused",
                    cache: str = "prealloc") -> int:
    """Transient bytes of one forward: the largest of :func:`workspace_phases` (never all live)."""
    phases = workspace_phases(config, dtype, tokens, attention=attention, cache=cache)
    return batch * max(fixed + per_token * context for fixed, per_token in phases.values())


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


@dataclass(frozen=True)
class Budget:
    """Fixed weights, KV per token, and ``workspace_at(context)``, under ``budget`` (what the
    allocator may hold); ``max_context`` and its ``workspace`` are computed once, for ``asdict``.
    A paged cache reserves KV in whole blocks of ``block`` tokens (1: exactly the tokens)."""

    weights: int
    kv_per_token: int
    budget: int
    workspace_at: InitVar[Callable[[int], int] | None] = None
    block: int = 1
    max_context: int = field(init=False)
    workspace: int = field(init=False)

    def __post_init__(self, workspace_at) -> None:
        object.__setattr__(self, "_workspace_at", workspace_at or (lambda context: 0))
        hi = max(1, (self.budget - self.weights) // self.kv_per_token + 1)  # the KV alone
        lo = largest(lambda n: self.breakdown(n)["free"] >= 0, hi)  # the workspace grows too
        object.__setattr__(self, "max_context", lo)
        object.__setattr__(self, "workspace", self._workspace_at(lo))

    def breakdown(self, context: int) -> dict[str, int]:
        """Bytes of each part at ``context`` tokens; ``free`` is negative past ``max_context``."""
        slots = -(-context // self.block) * self.block  # the last block is reserved whole
        kv, workspace = self.kv_per_token * slots, self._workspace_at(context)
        free = self.budget - self.weights - kv - workspace
        return {"weights": self.weights, "kv": kv, "workspace": workspace, "free": free}

    def __repr__(self) -> str:
        return (f"Budget({self.budget / GIB:.2f} GiB: weights {self.weights / GIB:.2f} GiB, "
                f"workspace {self.workspace / MIB:.1f} MiB, {self.kv_per_token / 1024:.0f} "
                f"KiB/token -> max_context={self.max_context:,})")


def plan_budget(config: PretrainedConfig, dtype: torch.dtype, budget_bytes: int, batch: int = 1,
                prefill_chunk: int = 512, *, attention: str = "fused", cache: str = "prealloc",
                block: int = 1, tp: int = 1) -> Budget:
    """The :class:`Budget` of ``config`` in ``dtype`` for kvlib's token loop; ``attention``:
    ``"fused"`` (sm >= 8.0) or ``"math"``, where kernels fall back (``cards.sdpa_kernel``).

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
    workspace = partial(run_workspace, config, dtype, prefill_chunk=prefill_chunk, batch=batch,
                        attention=attention, cache=cache)
    rope = 4 * head_dim(config)  # RoPE's inverse frequencies: two fp32 buffers of D / 2
    kv = kv_bytes_per_token(config, dtype, batch) * max(1, Hkv // tp) // Hkv
    return Budget(weight_bytes(config, dtype) // tp + rope, kv, int(budget_bytes), workspace,
                  block)
