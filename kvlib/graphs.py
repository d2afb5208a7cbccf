"""Static shapes, then a CUDA graph: what a cache that never moves makes possible.

A decode step launches hundreds of small kernels; for a small batch the GPU often waits on the Python
that launches them. A CUDA graph records the step's kernels once and replays them with one launch, but
only if every tensor the step touches keeps its address and shape. The preallocated cache gives the
addresses; the rest is made static here:

- the input token and the position live in fixed device buffers (``KVCache.write_at`` takes the position
  as a tensor);
- attention reads a fixed ``span`` of slots and masks those past the position. Slicing to the exact
  length would change shape every step; masking the whole buffer would read ``max_seq`` slots at every
  step. Spans in buckets of ``bucket`` slots sit between: one graph per bucket, at most ``bucket - 1``
  masked slots read.

:class:`StaticStep` runs that step with ``capture=False`` on any device (the CPU tests check its tokens
against the eager loop), and captures and replays it on CUDA. Sampling stays outside the graph: its RNG
state would be frozen in.
"""

import torch

from .decoder import forward_static

__all__ = ["StaticStep"]


class StaticStep:
    """``step(token [1, 1], pos) -> logits [1, vocab]`` with static shapes.

    The logits are the graph's output buffer: read them (pick the next token) before the next call
    overwrites them.
    """

    def __init__(self, model, cache, *, bucket: int = 256, capture: bool | None = None) -> None:
        if not hasattr(cache, "write_at"):
            raise TypeError(f"static shapes need a preallocated cache, not {type(cache).__name__}")
        device = cache.device
        self.capture = device.type == "cuda" if capture is None else capture
        if self.capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the cache is on {device}")
        self.model, self.cache, self.bucket = model, cache, int(bucket)
        self.token = torch.zeros(1, 1, dtype=torch.long, device=device)  # static inputs
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def span(self, pos: int) -> int:
        """Slots attention reads at position ``pos``: the bucket holding it."""
        return min(self.cache.max_seq, (pos // self.bucket + 1) * self.bucket)

    @torch.no_grad()
    def __call__(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        if not 0 <= pos < self.cache.max_seq:
            raise ValueError(f"KV overflow: writing slots {pos}..{pos + 1} into max_seq={self.cache.max_seq}")
        self.token.copy_(token)
        self.pos.fill_(pos)  # a scalar fill: no host sync
        span = self.span(pos)
        if not self.capture:
            logits = forward_static(self.model, self.token, self.cache, self.pos, span)
        else:
            if span not in self.graphs:
                self.graphs[span] = self._capture(span)
            graph, logits = self.graphs[span]
            graph.replay()
        self.cache.seq_len = pos + 1
        return logits

    def _capture(self, span: int):
        """Warm up on a side stream (lazy init must not be captured), then record."""
        run = lambda: forward_static(self.model, self.token, self.cache, self.pos, span)  # noqa: E731
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # rewrites this position's K/V with the same values
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = run()
        return graph, logits
