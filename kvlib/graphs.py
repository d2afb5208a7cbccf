"""Static shapes, then a CUDA graph: what a cache that never moves makes possible.

A graph replays a step's hundreds of kernel launches as one, if every tensor keeps its address and
shape: the preallocated cache, fixed token and position buffers, and attention over a fixed
``span`` of slots (buckets of them), masked past the position. Sampling stays outside (its RNG
state would freeze), and nothing reads a device value on the host: a replay would reuse the
capture's. A graph removes launches, not kernels, so the step runs few per layer: fused matmuls,
RoPE as one matmul, ``F.rms_norm``, split-KV: a second implementation of :mod:`kvlib.decoder`'s
layer, kept in step by the tests ``test_static_step_matches_transformers``,
``test_static_step_gives_eager_tokens_with_either_attention`` and
``test_graph_decode_gives_the_static_tokens``."""

import functools

import torch
import torch.nn.functional as F

from .attention import attend, splits
from .contract import StaticWrites, offers
from .decoder import no_cudnn_attention, parts, rope_of
from .env import resolve
from .memory import free

__all__ = ["StaticStep", "capture_graph", "fuse", "span", "unfuse"]

HOST_WAIT_ROPE = ("dynamic", "longrope")  # rotary updates that compare a position on the host
QKV, QK_NORMS = ("q_proj", "k_proj", "v_proj"), ("q_norm", "k_norm")
GATE_UP, MLP = ("gate_proj", "up_proj"), {"gate_proj", "up_proj", "down_proj", "act_fn"}


def _host_wait_rope(model) -> str | None:
    """The rope type, if any, that ``transformers`` rescales by comparing a position with a length
    in Python (``*dynamic*``; ``longrope`` before 5.24), a choice a CUDA graph would freeze."""
    kinds = getattr(getattr(getattr(model, "model", None), "rotary_emb", None), "rope_type", None)
    for kind in (kinds.values() if isinstance(kinds, dict) else [kinds]):
        if isinstance(kind, str) and any(k in kind for k in HOST_WAIT_ROPE):
            return kind
    return None


def _norm(norm, x: torch.Tensor) -> torch.Tensor:
    eps = getattr(norm, "variance_epsilon", None)  # Llama's RMSNorm and copies; not Gemma's 1 + w
    return norm(x) if eps is None else F.rms_norm(x, norm.weight.shape, norm.weight, eps)


@torch.no_grad()
def fuse(model) -> None:
    """Change ``model`` in place for the static step, its numbers unchanged (a :class:`StaticStep`
    calls it): each layer's q/k/v (and gate/up) weights and biases become views of one tensor, held
    on the module as ``_kvlib_fused``, and ``model.model._kvlib_rope`` is the model's RoPE. The
    weights stay held once; :func:`unfuse` gives each its own storage back and removes both."""
    model.model._kvlib_rope = rope_of(type(model.model.layers[0].self_attn))
    for module, names in [(m, n) for layer in model.model.layers for m, n in (
            (layer.self_attn, QKV), (layer.mlp, GATE_UP if parts(layer.mlp) == MLP else ()))]:
        layers, have = [getattr(module, n) for n in names], getattr(module, "_kvlib_fused", [None])
        if all(have[0] is not None and m.weight.untyped_storage()._cdata ==
               have[0].untyped_storage()._cdata for m in layers):
            continue  # fused already, or an MLP of another kind
        module._kvlib_fused = []
        for kind in ("weight", "bias"):
            pieces, at = [getattr(m, kind) for m in layers], 0
            whole = None if pieces[0] is None else torch.cat([p.detach() for p in pieces])
            for m, p in zip(layers, pieces if whole is not None else ()):
                setattr(m, kind, torch.nn.Parameter(whole[at : at + len(p)], p.requires_grad))
                at += len(p)
            module._kvlib_fused.append(whole)


@torch.no_grad()
def unfuse(model) -> None:
    """Undo :func:`fuse`: each fused weight and bias a tensor of its own, no ``_kvlib_*`` left."""
    model.model.__dict__.pop("_kvlib_rope", None)
    for module, names in [(m, n) for layer in model.model.layers for m, n in (
            (layer.self_attn, QKV), (layer.mlp, GATE_UP))]:
        if module.__dict__.pop("_kvlib_fused", None) is None:
            continue
        for m, kind in [(getattr(module, n), k) for n in names for k in ("weight", "bias")]:
            if (p := getattr(m, kind)) is not None:
                setattr(m, kind, torch.nn.Parameter(p.clone(), p.requires_grad))


def _rotations(model, x: torch.Tensor, pos: torch.Tensor, group: int) -> list[torch.Tensor]:
    """Per layer, ``R`` with ``rope(x) = x @ R`` at ``pos``: the model's own RoPE of an identity.
    RMS q/k norms fold in: ``diag(w) @ R``, ``[group + 1, D, D]``, group x Hkv queries, Hkv keys."""
    body, attns = model.model, [layer.self_attn for layer in model.model.layers]
    eye = torch.eye(attns[0].head_dim, dtype=x.dtype, device=x.device)[None, None]
    cos, sin = body.rotary_emb(x, pos.view(1, 1))  # [1, 1, D], scaling included
    R = body._kvlib_rope(eye, eye[:, :, :0], cos, sin, unsqueeze_dim=2)[0][0, 0]
    eps = {getattr(getattr(a, n, 0), "variance_epsilon", None) for a in attns for n in QK_NORMS}
    if len(eps) > 1 or None in eps:  # no q/k norms, or not all RMS with one eps: R alone
        return [R] * len(attns)
    w = torch.stack([n.weight for a in attns for n in [a.q_norm] * group + [a.k_norm]])
    return list((w.view(len(attns), group + 1, -1, 1) * R).unbind())


def _add_linear(x: torch.Tensor, h: torch.Tensor, linear) -> torch.Tensor:
    """``x + linear(h)``: one kernel (``addmm``) for a linear without bias."""
    return x + linear(h) if linear.bias is not None else torch.addmm(x, h, linear.weight.t())


def _layer(layer, x: torch.Tensor, i: int, R: torch.Tensor, attention, cache,
           pos: torch.Tensor, span: int) -> torch.Tensor:
    """One decoder layer for one token ``x`` ``[1, d]``."""
    attn, mlp, Hkv, D = layer.self_attn, layer.mlp, cache.n_kv_heads, layer.self_attn.head_dim
    heads = F.linear(_norm(layer.input_layernorm, x), *attn._kvlib_fused).view(-1, D)
    qk, v = heads[:-Hkv], heads[-Hkv:]  # views: [Hq + Hkv, D], [Hkv, D]
    if R.dim() == 3:  # [group + 1, D, D]: the q/k norms' weights are in R
        eps = attn.q_norm.variance_epsilon
        qk = torch.bmm(F.rms_norm(qk, (D,), eps=eps).view(len(R), Hkv, D), R).view(-1, D)
    else:
        if hasattr(attn, "q_norm"):  # norms of another kind: the model's own
            qk = torch.cat([attn.q_norm(qk[:-Hkv]), attn.k_norm(qk[-Hkv:])])
        qk = qk @ R
    cache.write_at(i, pos, qk[None, -Hkv:], v[None])
    o = attention(qk[:-Hkv].view(Hkv, -1, D), *cache.view(i, span), attn.scaling)
    x = _add_linear(x, o.view(1, -1), attn.o_proj)
    h = _norm(layer.post_attention_layernorm, x)
    if getattr(mlp, "_kvlib_fused", None) is None:
        return x + mlp(h)
    gate, up = F.linear(h, *mlp._kvlib_fused).chunk(2, -1)
    return _add_linear(x, mlp.act_fn(gate) * up, mlp.down_proj)


def _step(model, token, cache, pos: torch.Tensor, span: int, attention, P: int) -> torch.Tensor:
    """The static step of a fused model (:func:`fuse`): logits ``[1, V]``."""
    body, Hkv = model.model, cache.n_kv_heads
    x = body.embed_tokens(token)[0]  # [1, d]
    rotations = _rotations(model, x, pos, model.config.num_attention_heads // Hkv)
    step_attention = attend(attention, pos, span, P, x.dtype)
    for i, layer in enumerate(body.layers):
        x = _layer(layer, x, i, rotations[i], step_attention, cache, pos, span)
    return model.lm_head(_norm(body.norm, x))


def span(pos: int, bucket: int, max_seq: int) -> int:
    """Slots attention reads at position ``pos``: the bucket holding it, at most ``max_seq``."""
    return min(max_seq, (pos // bucket + 1) * bucket)


class StaticStep:
    """``step(token [1, 1], pos) -> logits [1, V]``, the graph's output buffer, which the next call
    overwrites (the graphs share one pool: :func:`kvlib.budget.graph_pool_bytes`). ``capture=False``
    runs it uncaptured, on any device. ``attention``: see :func:`kvlib.attention.attend`.
    ``compile``: True (inductor) or a backend's name compiles the step whole, once per span, with
    room for every span in dynamo's limit. cuDNN attention is off around it, outside the compile."""

    def __init__(self, model, cache, *, bucket: int = 256, capture: bool | None = None,
                 attention="split", compile: bool | str = False) -> None:
        if not offers(cache, StaticWrites):
            raise TypeError(f"static shapes need a preallocated cache, not {type(cache).__name__}")
        device = cache.device
        self.capture = device.type == "cuda" if capture is None else capture
        if self.capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the cache is on {device}")
        if (rope := _host_wait_rope(model)) is not None:
            raise NotImplementedError(f"rope_type {rope!r} updates its frequencies from the "
                                      f"positions on the host, which a static or graph step "
                                      f"cannot do; use step='eager'")
        attend(attention, torch.zeros(1, dtype=torch.long), 1, 1, torch.float32)  # refuse now
        fuse(model)
        self.model, self.cache, self.bucket, self.device = model, cache, int(bucket), device
        self.attention, self.run, self.compiled = attention, _step, set()
        if compile:
            self.run = torch.compile(_step, fullgraph=True, dynamic=False,
                                     backend="inductor" if compile is True else compile)
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.token = torch.zeros(1, 1, dtype=torch.long, device=device)  # static inputs
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.memory: dict[int, dict[str, int]] = {}

    def span(self, pos: int) -> int:
        return span(pos, self.bucket, self.cache.max_seq)

    @torch.no_grad()
    def __call__(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        if not 0 <= pos < self.cache.max_seq:
            raise ValueError(f"KV overflow: writing slots {pos}..{pos + 1} "
                             f"into max_seq={self.cache.max_seq}")
        self.token.copy_(token)
        self.pos.fill_(pos)  # a scalar fill: no host sync
        S = self.span(pos)
        P = splits(S, self.cache.n_kv_heads, self.device)
        run = lambda: self.run(self.model, self.token, self.cache, self.pos, S,  # noqa: E731
                               self.attention, P)
        limits, config = {}, torch._dynamo.config  # read only when a call compiles: a new span
        if self.run is not _step and S not in self.compiled:
            self.compiled.add(S)
            n = config.recompile_limit + -(-self.cache.max_seq // self.bucket)
            limits = dict(recompile_limit=n, accumulated_recompile_limit=max(
                n, config.accumulated_recompile_limit))
        with no_cudnn_attention(self.device), config.patch(**limits):
            if not self.capture:
                logits = run()
            else:
                if S not in self.graphs:
                    graph, out, self.memory[S] = capture_graph(run, self.device, self.pool)
                    self.graphs[S] = graph, out
                graph, logits = self.graphs[S]
                graph.replay()
        self.cache.seq_len = pos + 1
        return logits


@functools.cache
def _side_stream(index: int) -> torch.cuda.Stream:
    """One side stream per card for every warm-up and capture: cuBLAS keeps a workspace per
    stream, so a new stream per capture would leave one more workspace behind each time."""
    return torch.cuda.Stream(index)


def capture_graph(run, device: torch.device | str, pool=None):
    """``(graph, output, memory)``: ``run()`` captured after two warm-up calls (lazy init must not
    be captured), into ``pool`` (``torch.cuda.graph_pool_handle()``) if given, else a private one;
    ``memory``: what it added, from an emptied cache, as the capture empties it."""
    device = resolve(device)
    stream = _side_stream(device.index)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):  # a decode step rewrites its position's K/V with the same values
            run()
    torch.cuda.current_stream(device).wait_stream(stream)
    free(device)
    before = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        output = run()
    memory = {"allocated": torch.cuda.memory_allocated(device) - before[0],
              "reserved": torch.cuda.memory_reserved(device) - before[1]}
    return graph, output, memory
