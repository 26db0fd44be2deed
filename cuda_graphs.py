"""Decoding with CUDA graphs (on a GPU): a small model's decode step is many tiny kernels, and a
graph launches them at once. sampling.generate uses it where an agent has `graphs`, and falls back
to eager decoding if it fails.
"""
import torch
import transformers


class GraphDecoder:
    """Decode steps over a static KV cache, replayed as a CUDA graph. Fixed shapes: `rows` (batches padded to
    a power of two; finished rows stay, masked) and `length` cache slots. The first replay is checked
    against the eager step before it; on a mismatch `generate` falls back to the eager loop. Without
    CUDA (the tests) steps run eagerly."""
    rows_leave = False

    def __init__(self, agent, rows, length, forward_last):
        self.agent, self.forward_last, dev = agent, forward_last, agent.model.device
        self.cache = transformers.StaticCache(config=agent.model.config, max_cache_len=length)
        self.x, self.pos = (torch.zeros(rows, 1, dtype=torch.long, device=dev) for _ in range(2))
        self.attn, self.graph = torch.zeros(rows, length, dtype=torch.long, device=dev), None

    def forward(self, ids, attn, pos, cache_enabled=True):  # a capture needs autocast's cache off
        with self.agent.autocast(cache_enabled):
            return self.forward_last(ids, attn, pos, self.cache)

    def prefill(self, ids, attn, pos):
        self.cache.reset()
        self.attn.zero_()
        self.attn[:, :ids.shape[1]] = attn
        logits = self.forward(ids, self.attn, pos)
        if any(type(layer) is not transformers.cache_utils.StaticLayer for layer in self.cache.layers):
            raise RuntimeError("the model's cache layers are not plain static layers (sliding windows?)")
        return logits

    def step(self, tok, pos, slot):
        """One token per row, written to cache slot `slot`, at rope position `pos`."""
        self.x.copy_(tok[:, None])
        self.pos.copy_(pos)
        self.attn[:, slot].fill_(1)
        if self.x.device.type != "cuda":
            return self.forward(self.x, self.attn, self.pos)
        if self.graph is None:
            self.capture()
        else:
            self.graph.replay()
        return self.logits.clone()

    def capture(self):
        """Warm up on a side stream, capture, then replay this very step and check it."""
        counts, stream = [layer.cumulative_length.clone() for layer in self.cache.layers], torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            want = self.forward(self.x, self.attn, self.pos).clone()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.forward(self.x, self.attn, self.pos, cache_enabled=False)
        for layer, n in zip(self.cache.layers, counts):  # the warm-up wrote this slot: write it again
            layer.cumulative_length.copy_(n)
        self.graph.replay()
        if not torch.allclose(self.logits.float(), want.float(), rtol=1e-3, atol=1e-3):
            raise RuntimeError("the graph's logits differ from the eager forward's")


def graph_decoder(agent, rows, length, forward_last):
    """The agent's GraphDecoder for this shape, cache slots rounded up to 256; one shape at a time,
    since a static cache can be large. forward_last(ids, attn, pos, cache): the last position's logits of the
    model that samples (sampling.py's)."""
    key = (rows, -(-length // 256) * 256)
    if key not in agent.graphs:
        agent.graphs.clear()
        agent.graphs[key] = GraphDecoder(agent, *key, forward_last)
    return agent.graphs[key]
