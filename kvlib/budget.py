"""The memory budget, computed before anything runs.

A decoding model's memory is three things: the weights (fixed), the KV cache (grows by
:func:`kv_bytes_per_token` with every token), and a transient workspace for one forward pass. All three
follow from the Hugging Face config by arithmetic, so the longest context that fits a budget is known
before a single byte is allocated:

    max_context = (budget - weights - workspace) // kv_bytes_per_token

The arithmetic is checked against the real architecture built on the ``meta`` device
(:func:`meta_param_count`): full scale, no memory.
"""

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from .config import GIB, MIB, head_dim, kv_bytes_per_token, kv_heads

__all__ = ["Budget", "meta_param_count", "param_count", "plan_budget", "weight_bytes", "workspace_bytes"]

FAMILIES = ("llama", "qwen2", "qwen3")  # the families param_count can count


def param_count(config: PretrainedConfig) -> int:
    """Parameters of a Llama / Qwen2 / Qwen3 causal LM, by arithmetic on the config.

    Per layer: q/k/v/o projections (Qwen2 always biases q/k/v; ``attention_bias`` biases all four),
    Qwen3's per-head ``q_norm``/``k_norm``, the gated MLP (gate/up/down), two RMSNorms. Plus the
    embedding, the final norm, and an output head unless it is tied to the embedding.
    """
    kind = config.model_type
    if kind not in FAMILIES:
        raise ValueError(f"param_count knows {FAMILIES}, not model_type={kind!r}")
    h, inter, vocab, hd = config.hidden_size, config.intermediate_size, config.vocab_size, head_dim(config)
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


def meta_param_count(config: PretrainedConfig) -> int:
    """Parameters of the real ``transformers`` model, built on ``meta``: shapes, no memory.

    ``parameters()`` yields a tied weight once, as :func:`param_count` counts it.
    """
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def workspace_bytes(config: PretrainedConfig, dtype: torch.dtype, tokens: int = 1, batch: int = 1, *,
                    context: int | None = None) -> int:
    """Estimated transient memory of one forward over ``tokens`` new tokens.

    The terms are not live at the same time (a layer's MLP activations are freed before the next layer's
    attention, the logits come after the last layer), so the workspace is the largest of them::

        logits = batch * vocab * (elt + 4 if elt < 4 else elt)  # last position, + fp32 copy
        mlp    = 3 * batch * tokens * intermediate * elt        # gate, up, act(gate) * up
        scores = batch * heads * tokens * context * elt         # math-path SDPA only

    kvlib keeps logits for the last position only, so ``tokens`` does not multiply them, and assumes
    they are upcast to float32 for sampling. The fused SDPA kernels (flash, memory-efficient) never
    materialise the scores: pass ``context`` (the keys attended to) only to price the math path, whose
    softmax may briefly double that term. An estimate, to compare with a measurement; the
    small residual stream is left out.
    """
    elt = dtype.itemsize
    logits = batch * config.vocab_size * (elt + 4 if elt < 4 else elt)
    mlp = 3 * batch * tokens * config.intermediate_size * elt
    scores = batch * config.num_attention_heads * tokens * (context or 0) * elt
    return max(logits, mlp, scores)


@dataclass(frozen=True)
class Budget:
    """Bytes of a memory budget: fixed weights, a fixed workspace, KV per token.

    ``budget`` is what the caching allocator may hold (the CUDA context lies outside it and is not
    counted).
    """

    weights: int
    kv_per_token: int
    workspace: int
    budget: int

    @property
    def max_context(self) -> int:
        """The most tokens of KV that fit next to the weights and workspace."""
        return max(0, (self.budget - self.weights - self.workspace) // self.kv_per_token)

    def breakdown(self, context: int) -> dict[str, int]:
        """Bytes of each part at ``context`` tokens; ``free`` is negative past ``max_context``."""
        kv = self.kv_per_token * context
        free = self.budget - self.weights - kv - self.workspace
        return dict(weights=self.weights, kv=kv, workspace=self.workspace, free=free)

    def __repr__(self) -> str:
        return (f"Budget({self.budget / GIB:.2f} GiB: weights {self.weights / GIB:.2f} GiB, workspace "
                f"{self.workspace / MIB:.1f} MiB, {self.kv_per_token / 1024:.0f} KiB/token -> "
                f"max_context={self.max_context:,})")


def plan_budget(config: PretrainedConfig, dtype: torch.dtype, budget_bytes: int, batch: int = 1,
                prefill_chunk: int = 512) -> Budget:
    """The :class:`Budget` of ``config`` in ``dtype`` under ``budget_bytes``.

    The workspace is priced for a prefill chunk of ``prefill_chunk`` tokens (a decode step needs less)
    with a fused attention kernel; see :func:`workspace_bytes` for the math path.
    """
    if budget_bytes <= 0 or batch < 1 or prefill_chunk < 1:
        raise ValueError(f"bad budget: budget_bytes={budget_bytes} batch={batch} "
                         f"prefill_chunk={prefill_chunk}")
    return Budget(weights=weight_bytes(config, dtype), kv_per_token=kv_bytes_per_token(config, dtype, batch),
                  workspace=workspace_bytes(config, dtype, tokens=prefill_chunk, batch=batch),
                  budget=int(budget_bytes))
