"""Sampling and scoring, side by side because they must agree: `generate` samples a turn for a batch of
contexts and keeps each sampled token's log-prob; `token_logprobs` recomputes those log-probs in
training. Both read the raw logits at temperature 1, so the policy that samples is the policy that
is trained (the ratio of the clipped objective is 1 before the first update). In fp32 they agree to
1e-5. With --dtype bfloat16 the sampler is a bf16 copy of the weights (`sampler`) and training runs
autocast over the fp32 weights: their log-probs differ by a bf16 rounding, which training accounts
for (mgrpo.truncated_is_weight).

Why not HF `generate`: it fills every field a `GenerationConfig` leaves unset from the model's own
`generation_config`, and instruct models ship a temperature, top-k, top-p and repetition penalty
there. Such a model would be sampled from another policy than the one trained. Nothing in
`generation_config` is read here.
"""
import contextlib
import copy
import functools
import inspect
import math

import torch
import transformers

from cuda_graphs import graph_decoder


def sample_token(logits, suppress, generator, greedy=False):
    """Draw one token per row from the raw logits [B, V]: (tokens, their log-probs).

    The log-prob kept is the token's under the raw distribution, log_softmax(logits) in fp32:
    the policy that `token_logprobs` recomputes in training. Suppressed ids (pad, unk: they would
    look like padding) are removed before the draw, which is at temperature 1 (the argmax when
    greedy); no top-k, top-p or repetition penalty. The draw inverts the cumulative distribution, in
    fp64, at a uniform number in (0, 1] (so a token of probability 0 is never drawn): what
    torch.multinomial does, which takes 40 times as long on a CPU over a 49k vocabulary.
    """
    logp = logits.float().log_softmax(-1)
    allowed = logp.index_fill(-1, suppress, -math.inf) if len(suppress) else logp
    if greedy:
        tok = allowed.argmax(-1)
    else:
        cdf = allowed.double().exp().cumsum(-1)
        if not bool((torch.isfinite(cdf[:, -1]) & (cdf[:, -1] > 0)).all()):
            raise FloatingPointError("the model's next-token probabilities are not finite or all 0: its weights "
                                     "or its input are broken")
        u = 1 - torch.rand(len(cdf), 1, dtype=torch.float64, generator=generator, device=cdf.device)
        tok = torch.searchsorted(cdf, u * cdf[:, -1:])[:, 0].clamp(max=cdf.shape[-1] - 1)
    return tok, logp.gather(-1, tok[:, None])[:, 0]


@functools.lru_cache(maxsize=None)
def cache_keyword(model_class):
    """The forward's name for the KV cache: past_key_values, renamed cache in transformers 5.2x."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def forward_last(model, ids, attn, pos, cache):
    """Logits of the last position [B, V]; the KV cache grows (or fills) by the new positions. The body, then
    the head on the last states alone, as 2-D rows: HF's logits_to_keep=1 hands the head a strided [B, 1, H]
    slice, which torch multiplies by copying the head's weight once per row (a prefill of SmolLM2 at 8 rows:
    0.9 s in bf16 on a CPU, against 2.5 ms for the same rows as 2-D). token_logprobs scores as body and head too."""
    body = model.get_decoder()
    h = body(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
             **{cache_keyword(type(body)): cache}).last_hidden_state
    return model.get_output_embeddings()(h[:, -1])


def left_pad(contexts, pad_id, rows, device):
    """[rows, L] ids and attention mask, each context flush right; rows past the contexts repeat the first."""
    L = max(map(len, contexts))
    ids = torch.full((rows, L), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, c in enumerate(contexts + [contexts[0]] * (rows - len(contexts))):
        ids[b, L - len(c):] = torch.tensor(c, dtype=torch.long)
        attn[b, L - len(c):] = 1
    return ids.to(device), attn.to(device)


class Kept:
    """One conversation's KV cache, kept from one turn to the next: the keys and values of its first
    `n` tokens, per layer ([kv heads, n, head dim] each; a shared prompt's are shared, not copied)."""
    __slots__ = ("n", "layers")

    def __init__(self):
        self.n, self.layers = 0, None


MIN_PREFIX = 16  # tokens of a prompt shared by a batch's new conversations worth a cache of their own
KEEP_MIN = 64  # mean context length from which a batch's KV is kept: below, copying rows costs more than
# the few tokens it saves (word-level contexts; measured in docs/benchmarks.md)


def weights_version(model):
    """Grows whenever a weight is written in place (an optimizer step, a load): the prefix cache's key."""
    return sum(p._version for p in model.parameters())


def sampler(agent):
    """The model that samples: the agent's own, or with --dtype bfloat16 (all weights trained; LoRA's base is
    bf16 already) a bf16 copy of it, refreshed in place whenever a weight was written (weights_version).
    Decoding reads every weight for every token: a bf16 copy reads half the bytes of fp32 weights and spares
    autocast a cast of each of them at every step. Its buffers (rotary frequencies) stay fp32, as training's.
    The copy's log-probs differ from training's autocast ones; mgrpo.truncated_is_weight accounts for it."""
    if not agent.bf16 or agent.peft:
        return agent.model
    version = weights_version(agent.model)
    if agent.copy is None:  # each parameter made bf16 as it is copied (tied ones stay one), the buffers copied
        bf16 = {id(p): torch.nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=False)
                for p in agent.model.parameters()}
        agent.copy = [version, copy.deepcopy(agent.model, bf16)]
    elif agent.copy[0] != version:
        with torch.no_grad():
            for q, p in zip(agent.copy[1].parameters(), agent.model.parameters()):
                q.copy_(p)
        agent.copy[0] = version
    return agent.copy[1]


def kv_alone(agent, ids):
    """[(keys, values)] per layer of one sequence, [kv heads, len, head dim] each."""
    model = sampler(agent)
    cache = transformers.DynamicCache(config=model.config)
    pos = torch.arange(len(ids), device=model.device)[None]
    with agent.autocast():
        forward_last(model, torch.tensor([ids], device=pos.device), torch.ones_like(pos), pos, cache)
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def common_prefix(ids, attn):
    """How many first positions all rows share, ids and attention mask alike (a shared prompt)."""
    same = ((ids == ids[:1]) & (attn == attn[:1])).all(0)
    return len(same) if same.all() else int(same.int().argmin())


def share_prompt(agent, contexts, kept):
    """New conversations (nothing kept yet) start from the KV of the prompt they share (the longest
    common prefix, less each one's last token), computed once per set of weights: agent.prefixes."""
    fresh = [b for b, k in enumerate(kept) if k.n == 0]
    n = min((len(contexts[b]) for b in fresh), default=0) - 1
    if n < MIN_PREFIX:
        return
    ids = torch.tensor([contexts[b][:n] for b in fresh])
    n = common_prefix(ids, torch.ones_like(ids))
    if n < MIN_PREFIX:
        return
    key, version = tuple(contexts[fresh[0]][:n]), weights_version(agent.model)
    if agent.prefixes.get(key, (None,))[0] != version:
        if len(agent.prefixes) >= 8:  # a few prompts at a time: their caches can be large
            agent.prefixes.clear()
        agent.prefixes[key] = (version, kv_alone(agent, list(key)))
    for b in fresh:
        kept[b].n, kept[b].layers = n, agent.prefixes[key][1]


class Slab(transformers.cache_utils.DynamicLayer):
    """One layer's KV cache in buffers of `capacity` positions, allocated at the first write and then written in
    place, so that a decode step copies nothing (DynamicLayer grows by torch.cat: a copy of the whole cache at
    every token, a fifth of a decode step at a few hundred tokens of context). keys and values are views of
    the positions written so far."""

    def __init__(self, capacity):
        super().__init__()
        self.capacity = capacity

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        self.k_buf, self.v_buf = (x.new_empty(*x.shape[:2], self.capacity, x.shape[3])
                                  for x in (key_states, value_states))
        self.written(0)

    def written(self, n):
        """The first n positions hold keys and values."""
        self.keys, self.values = self.k_buf[:, :, :n], self.v_buf[:, :, :n]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, m = self.keys.shape[2], key_states.shape[2]
        self.k_buf[:, :, n:n + m], self.v_buf[:, :, n:n + m] = key_states, value_states
        self.written(n + m)
        return self.keys, self.values

    def batch_select_indices(self, indices):
        n = self.keys.shape[2]
        self.k_buf, self.v_buf = self.k_buf[indices], self.v_buf[indices]
        self.written(n)


def new_cache(model, capacity):
    """A KV cache for a decode of at most `capacity` positions: Slab layers, or where the model has layers
    of another kind (sliding windows), transformers' DynamicCache."""
    cache = transformers.DynamicCache(config=model.config)
    if any(type(layer) is not transformers.cache_utils.DynamicLayer for layer in cache.layers):
        return cache
    return transformers.cache_utils.Cache(layers=[Slab(capacity) for _ in cache.layers])


LEAVE = 0.5  # finished rows leave the batch once they are this share of it; until then they ride along (cut from
# the result): a decode step of SmolLM2 on a CPU costs about as much for 8 rows as for 16, and each leave copies
# the whole cache


class EagerDecoder:
    """Decode steps over a KV cache written in place (Slab); finished rows leave the batch once they are
    LEAVE of it. With `kept` (one Kept per context), each row's KV from earlier turns is reused: only the
    tokens after it are prefilled (ragged, their padding masked), and a row's KV is kept again as it
    leaves."""
    rows_leave = True

    def __init__(self, agent, kept=None):
        self.agent, self.kept, self.model = agent, kept, sampler(agent)

    def prefill(self, contexts, n_new):
        """The contexts into the cache: (last position's logits, each row's next position [B, 1])."""
        dev, self.rows, self.lengths = self.model.device, list(range(len(contexts))), list(map(len, contexts))
        if self.kept is None:
            ids, self.attn = left_pad(contexts, self.agent.pad_id, len(contexts), dev)
            pos = (self.attn.cumsum(-1) - 1).clamp(min=0)  # positions count real tokens only
            self.cache = new_cache(self.model, ids.shape[1] + n_new)
        else:
            if any(k.n >= len(c) for c, k in zip(contexts, self.kept)):
                raise ValueError("a kept KV cache is as long as its context: a Kept goes with its own "
                                 "conversation, grown since the turn that kept it")
            share_prompt(self.agent, contexts, self.kept)
            ids, self.attn, pos = self.load_kept(contexts, n_new)
        with self.agent.autocast():
            logits = forward_last(self.model, ids, self.attn, pos, self.cache)
        return logits, torch.tensor(self.lengths, device=dev)[:, None]

    def load_kept(self, contexts, n_new):
        """The kept KV into the cache, row b as [padding, its n_b kept]; the rest of each context as a
        block, row b as [padding, its tokens after n_b]: (block ids, attention mask, block positions)."""
        kept, B, dev = self.kept, len(contexts), self.model.device
        C, N = max(k.n for k in kept), max(len(c) - k.n for c, k in zip(contexts, kept))
        attn = torch.zeros(B, C + N, dtype=torch.long, device=dev)
        ids = torch.full((B, N), self.agent.pad_id, dtype=torch.long, device=dev)
        pos = torch.zeros(B, N, dtype=torch.long, device=dev)
        for b, (c, k) in enumerate(zip(contexts, kept)):
            rest = c[k.n:]
            attn[b, C - k.n:C], attn[b, C + N - len(rest):] = 1, 1
            ids[b, N - len(rest):] = torch.tensor(rest, device=dev)
            pos[b, N - len(rest):] = torch.arange(k.n, len(c), device=dev)
        self.cache = new_cache(self.model, C + N + n_new)
        donor = next((k for k in kept if k.n), None)
        for i, layer in enumerate(self.cache.layers if donor else []):
            K, V = (x.new_zeros(B, x.shape[0], C, x.shape[2]) for x in donor.layers[i])
            for b, k in enumerate(kept):
                if k.n:
                    K[b, :, C - k.n:], V[b, :, C - k.n:] = k.layers[i]
            layer.update(K, V)
        return ids, attn, pos

    def save(self, batch_rows, forwarded):
        """Keep the KV of these batch rows: their context and the first forwarded[r] tokens of their turn."""
        for r in batch_rows:
            k = self.kept[self.rows[r]]
            k.n = self.lengths[self.rows[r]] + int(forwarded[r])
            real = self.attn[r].nonzero()[:k.n, 0]  # a finished row that rode along attended tokens past its end
            k.layers = [(layer.keys[r].index_select(1, real), layer.values[r].index_select(1, real))
                        for layer in self.cache.layers]

    def keep(self, rows, forwarded):
        """Only these batch rows go on; the others' KV is kept first (with `kept`). forwarded: per batch row,
        the tokens of its turn that went through the model."""
        if self.kept is not None:
            going = set(rows.tolist())
            self.save([r for r in range(len(self.rows)) if r not in going], forwarded)
        self.cache.batch_select_indices(rows)
        self.attn, self.rows = self.attn[rows], [self.rows[r] for r in rows.tolist()]

    def finish(self, forwarded):
        if self.kept is not None:
            self.save(range(len(self.rows)), forwarded)

    def step(self, tok, pos, slot):
        self.attn = torch.cat([self.attn, self.attn.new_ones(len(tok), 1)], 1)
        with self.agent.autocast():
            return forward_last(self.model, tok[:, None], self.attn, pos, self.cache)


@torch.no_grad()
def generate(agent, contexts, max_new_tokens, seed, greedy=False, kept=None):
    """Sample one turn for a batch of contexts: per context (new ids, their log-probs, ended?).

    The left-padded contexts go through the model once (prefill, into a KV cache, keeping the last
    position's logits); then one token per forward. Each token is drawn by `sample_token` with a
    torch.Generator seeded from `seed`, so a call does not depend on what ran before. A row ends at
    its first stop token; finished rows leave the batch once they are LEAVE of it. kept: one `Kept`
    per context, from the turn before (the conversation's KV) or new; then only what follows a row's
    kept KV is prefilled, new conversations start from their shared prompt's KV, and each row's KV is
    kept for its next turn (for contexts of KEEP_MIN tokens or more on average; shorter ones are
    prefilled whole). With `agent.graphs` (on a GPU) the steps replay a CUDA graph over a static cache
    instead (`GraphDecoder`: every context prefilled whole), and finished rows stay, masked; if that
    fails, this agent decodes eagerly from then on.
    """
    if agent.graphs is not None:
        try:
            return decode(agent, contexts, max_new_tokens, seed, greedy)
        except RuntimeError as e:
            print(f"CUDA graphs off for this agent ({e}); decoding eagerly", flush=True)
            agent.graphs = None
    return decode(agent, contexts, max_new_tokens, seed, greedy, kept)


def decode(agent, contexts, n_new, seed, greedy, kept=None):
    """generate's loop, with a GraphDecoder when the agent has graphs, else an EagerDecoder."""
    B, dev, static = len(contexts), agent.model.device, agent.graphs is not None
    R, L = B, 0  # rows (a graph's: a power of two), and the cache slot of the first new token
    if static:
        R = 1 << (B - 1).bit_length()
        ids, attn = left_pad(contexts, agent.pad_id, R, dev)
        L = ids.shape[1]
        decoder = graph_decoder(agent, R, L + n_new, lambda *a: forward_last(sampler(agent), *a))
        logits = decoder.prefill(ids, attn, (attn.cumsum(-1) - 1).clamp(min=0))
        next_pos = attn.sum(-1, keepdim=True)
    else:
        decoder = EagerDecoder(agent, kept if kept and sum(map(len, contexts)) >= KEEP_MIN * B else None)
        logits, next_pos = decoder.prefill(contexts, n_new)
    gen = torch.Generator(dev).manual_seed(seed)
    suppress = torch.tensor(agent.suppress, dtype=torch.long, device=dev)
    stop_ids = torch.tensor(agent.stop_ids, dtype=torch.long, device=dev)
    new = torch.full((R, n_new), agent.pad_id, dtype=torch.long, device=dev)
    new_lp = torch.zeros(R, n_new, device=dev)
    length = torch.full((R,), n_new, device=dev)     # a row's turn ends at its first stop token
    running = torch.ones(R, dtype=torch.bool, device=dev)
    rows = torch.arange(R, device=dev)  # the rows still sampling
    for t in range(n_new):
        tok, lp = sample_token(logits, suppress, gen, greedy)
        new[rows, t], new_lp[rows, t] = tok, lp  # a finished row's draws past its end are cut below
        done = torch.isin(tok, stop_ids) & running[rows]
        length[rows[done]] = t + 1
        running[rows[done]] = False
        if t == n_new - 1 or not running[:B].any():
            break
        going = running[rows]
        if decoder.rows_leave and (~going).sum() >= max(1.0, LEAVE * len(rows)):
            keep = going.nonzero()[:, 0]
            decoder.keep(keep, length[rows].clamp(max=t))  # each row's tokens through the model so far
            rows, tok, next_pos = rows[keep], tok[keep], next_pos[keep]
        logits = decoder.step(tok, next_pos + t, L + t)
    if not static:
        decoder.finish(length[rows].clamp(max=t))
    out = []
    for row, lp, n in zip(new[:B].tolist(), new_lp[:B].tolist(), length[:B].long().tolist()):
        out.append((row[:n], lp[:n], row[n - 1] in agent.stop_ids))
    return out


def token_logprobs(model, ids, attn, mask=None):
    """logp[b, t] = log p(ids[b, t] | ids[b, :t]), and 0 at padding and at each row's first
    token (nothing predicts it). Any padding side: position ids come from the attention mask,
    so a padded row is scored as if it were unpadded; the state at t-1 predicts the token at t.
    mask: log-probs only where it is 1 (0 elsewhere): the model's body runs over every position,
    its head and log-softmax only over those, since with a large vocabulary the logits of a whole
    context (prompt and tool output included) are most of a micro-batch's memory.
    A prompt that all rows share (MIN_PREFIX tokens or more) goes through the model once, on one
    row, and its KV is repeated for the others: the same log-probs, and gradients summed over the
    rows through the repeat, for a fraction of the work when the prompt is most of each row (chat
    models). Not with gradient checkpointing, which drops the cache in training."""
    n = min(common_prefix(ids, attn), ids.shape[1] - 1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    keep = attn[:, 1:] * attn[:, :-1] * (1 if mask is None else mask[:, 1:])
    checkpointing = model.training and any(getattr(m, "gradient_checkpointing", False) is True
                                           for m in model.modules())
    body = model.get_decoder()
    if len(ids) < 2 or n < MIN_PREFIX or checkpointing:
        h = body(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).last_hidden_state
        lp = head_logp(model, h[:, :-1], ids[:, 1:], keep, mask is None)
    else:
        cache, key = transformers.DynamicCache(config=model.config), cache_keyword(type(body))
        first = body(input_ids=ids[:1, :n], attention_mask=attn[:1, :n], position_ids=pos[:1, :n],
                     use_cache=True, **{key: cache}).last_hidden_state
        cache.batch_repeat_interleave(len(ids))
        rest = body(input_ids=ids[:, n:], attention_mask=attn, position_ids=pos[:, n:], use_cache=True,
                    **{key: cache}).last_hidden_state
        lp = torch.cat([head_logp(model, first, ids[:, 1:n + 1], keep[:, :n], mask is None),
                        head_logp(model, rest[:, :-1], ids[:, n + 1:], keep[:, n:], mask is None)], 1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], 1)


def reference_logprobs(agent, batch, micro_batch=0):
    """--kl-coef: the frozen reference's log-probs of a collated batch, micro-batch by micro-batch,
    without gradient: a copy of the agent as RL started (agent.ref), or with LoRA its own base, the
    adapter switched off."""
    off = agent.peft.disable_adapter() if agent.peft else contextlib.nullcontext()
    with off:
        return batch_logprobs(agent, agent.model if agent.ref is None else agent.ref, batch, micro_batch)


@torch.no_grad()
def batch_logprobs(agent, model, batch, micro_batch=0):
    """token_logprobs of a collated batch where its loss mask is 1, micro-batch by micro-batch, without
    gradient, under the agent's autocast."""
    ids, attn, mask, _ = batch
    mb = micro_batch or len(ids)
    with agent.autocast():
        return torch.cat([token_logprobs(model, ids[s:s + mb], attn[s:s + mb], mask[s:s + mb])
                          for s in range(0, len(ids), mb)])


def head_logp(model, h, targets, keep, everywhere=True):
    """log p(targets) from the body's last states h [B or 1, T, H], in fp32, times keep [B, T]: the
    head at every position, or (everywhere=False) only where keep is 1. h is made contiguous first: a
    strided slice goes to the head as a batched matmul over a copy of its weight per row (forward_last)."""
    if everywhere:
        return next_logp(model.get_output_embeddings()(h.contiguous()), targets) * keep
    at = keep.nonzero(as_tuple=True)
    h = h.expand(len(targets), -1, -1)
    lp = next_logp(model.get_output_embeddings()(h[at])[None], targets[at][None])[0]
    return torch.zeros(targets.shape, dtype=lp.dtype, device=h.device).index_put(at, lp)


def next_logp(logits, targets):
    """log_softmax(logits) at the targets, in fp32: [B or 1, T, V], [B, T] -> [B, T]."""
    logp = logits.float().log_softmax(-1).expand(len(targets), -1, -1)
    return logp.gather(-1, targets[..., None])[..., 0]


def collate(trajs, pad_id, device):
    """Right-padded tensors (ids, attention mask, loss mask, sampling log-probs) of trajectories; the
    attention mask comes from lengths, never from token ids (pad may equal eos)."""
    B, T = len(trajs), max(len(t.ids) for t in trajs)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn, mask, old = torch.zeros_like(ids), torch.zeros_like(ids), torch.zeros(B, T)
    for b, t in enumerate(trajs):
        n = len(t.ids)
        ids[b, :n], attn[b, :n] = torch.tensor(t.ids), 1
        mask[b, :n], old[b, :n] = torch.tensor(t.mask), torch.tensor(t.logp)
    return ids.to(device), attn.to(device), mask.to(device), old.to(device)
