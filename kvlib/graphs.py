"""Static shapes, then a CUDA graph: what a cache that never moves makes possible.

A graph replays a step's hundreds of kernel launches as one, if every tensor keeps its address and
shape: the preallocated cache, fixed token and position buffers, and attention over a fixed
``span`` of slots, masked past the position. Spans come in buckets, between a new shape every step
and reading all ``max_seq`` slots every step. Sampling stays outside (its RNG state would freeze),
and nothing reads a device value on the host: a replay would reuse the capture's answer.
"""

import functools
import gc

import torch

from .decoder import forward_static
from .env import resolve

__all__ = ["StaticStep", "capture_graph"]

HOST_WAIT_ROPE = ("dynamic", "longrope")  # rotary updates that compare a position on the host


def _host_wait_rope(model) -> str | None:
    """The rope type, if any, that ``transformers`` rescales by comparing a position with a length
    in Python (``*dynamic*``; ``longrope`` before 5.24), a choice a CUDA graph would freeze."""
    kinds = getattr(getattr(getattr(model, "model", None), "rotary_emb", None), "rope_type", None)
    for kind in (kinds.values() if isinstance(kinds, dict) else [kinds]):
        if isinstance(kind, str) and any(k in kind for k in HOST_WAIT_ROPE):
            return kind
    return None


class StaticStep:
    """``step(token [1, 1], pos) -> logits [1, V]``, the graph's output buffer, which the next call
    overwrites. ``capture=False`` runs it uncaptured, on any device."""

    def __init__(self, model, cache, *, bucket: int = 256, capture: bool | None = None) -> None:
        if not hasattr(cache, "write_at"):
            raise TypeError(f"static shapes need a preallocated cache, not {type(cache).__name__}")
        device = cache.device
        self.capture = device.type == "cuda" if capture is None else capture
        if self.capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the cache is on {device}")
        rope = _host_wait_rope(model)
        if rope is not None:
            raise NotImplementedError(f"rope_type {rope!r} updates its frequencies from the "
                                      f"positions on the host, which a static or graph step "
                                      f"cannot do; use step='eager'")
        self.model, self.cache, self.bucket, self.device = model, cache, int(bucket), device
        self.token = torch.zeros(1, 1, dtype=torch.long, device=device)  # static inputs
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.memory: dict[int, dict[str, int]] = {}

    def span(self, pos: int) -> int:
        """Slots attention reads at position ``pos``: the bucket holding it."""
        return min(self.cache.max_seq, (pos // self.bucket + 1) * self.bucket)

    @torch.no_grad()
    def __call__(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        if not 0 <= pos < self.cache.max_seq:
            raise ValueError(f"KV overflow: writing slots {pos}..{pos + 1} "
                             f"into max_seq={self.cache.max_seq}")
        self.token.copy_(token)
        self.pos.fill_(pos)  # a scalar fill: no host sync
        span = self.span(pos)
        run = lambda: forward_static(self.model, self.token, self.cache, self.pos, span)  # noqa: E731
        if not self.capture:
            logits = run()
        else:
            if span not in self.graphs:
                graph, out, self.memory[span] = capture_graph(run, self.device)
                self.graphs[span] = graph, out
            graph, logits = self.graphs[span]
            graph.replay()
        self.cache.seq_len = pos + 1
        return logits


@functools.cache
def _side_stream(index: int) -> torch.cuda.Stream:
    """One side stream per card for every warm-up and capture: cuBLAS keeps a workspace per
    stream, so a new stream per capture would leave one more workspace behind each time."""
    return torch.cuda.Stream(index)


def capture_graph(run, device: torch.device | str):
    """``(graph, output, memory)``: ``run()`` captured after two warm-up calls (lazy init must not
    be captured); ``memory``: what it added, from an emptied cache, as the capture empties it."""
    device = resolve(device)
    stream = _side_stream(device.index)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):  # a decode step rewrites its position's K/V with the same values
            run()
    torch.cuda.current_stream(device).wait_stream(stream)
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        output = run()
    memory = {"allocated": torch.cuda.memory_allocated(device) - before[0],
              "reserved": torch.cuda.memory_reserved(device) - before[1]}
    return graph, output, memory
