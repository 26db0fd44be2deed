"""mgrpo's own sampling loop: what it draws, and the log-probs it stores for the ratio."""
import copy
import math

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

import helpers
import mgrpo
import toy_tools
from agents import Traj, checkpoint_activations, message_ids, prompt_ids
import sampling
from sampling import Kept, collate, generate, token_logprobs


@pytest.fixture(scope="module")
def word_agent():
    return helpers.load_agent("", mgrpo.parse_args([]), seed=0)


@pytest.fixture(scope="module")
def chat_agent():
    return helpers.load_agent("", mgrpo.parse_args(["--chat", "--model-size", "0.1M"]), seed=0)


def biased(agent, bias):
    """A copy of the agent whose logits get `bias` ({token id: added logit}) added: part of the
    model, so sampling and training see it alike."""
    a = copy.deepcopy(agent)
    b = torch.zeros(a.model.config.vocab_size)
    for i, v in bias.items():
        b[i] = v
    a.model.lm_head.register_forward_hook(lambda module, inputs, out: out + b)
    return a


def decisive(agent):
    """A copy of the agent with larger weights than at initialisation: its greedy turns differ by context."""
    a, g = copy.deepcopy(agent), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in a.model.parameters():
            if p.dim() == 2:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return a


def contexts(agent, who="main"):
    texts = ["country of ada ?", "country of friend of bo ?", "city of cy", "friend of dex", "country of avon"]
    return [prompt_ids(agent, who, t) for t in texts]


def hub_like(agent):
    """The agent with what instruct models ship in their generation_config."""
    a = copy.deepcopy(agent)
    a.model.generation_config = GenerationConfig(do_sample=True, temperature=0.7, repetition_penalty=1.1, top_k=20,
                                                 top_p=0.8)
    return a


@pytest.mark.parametrize("which", ["word", "chat"])
def test_generation_config_of_the_model_changes_nothing(which, word_agent, chat_agent):
    agent = word_agent if which == "word" else chat_agent
    ctx = contexts(agent, "sub")
    for seed in range(3):
        plain = mgrpo.generate(agent, ctx, 12, seed)
        hub = mgrpo.generate(hub_like(agent), ctx, 12, seed)
        assert plain == hub  # the same tokens, log-probs and ends, exactly
    # the setting itself does change what HF generate samples with the model's defaults
    L = max(map(len, ctx))
    ids = torch.tensor([[agent.pad_id] * (L - len(c)) + c for c in ctx])
    attn = (torch.arange(L)[None] >= torch.tensor([L - len(c) for c in ctx])[:, None]).long()
    outs = []
    for a in (agent, hub_like(agent)):
        torch.manual_seed(0)
        outs.append(a.model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=12, do_sample=True,
                                     pad_token_id=agent.pad_id).tolist())
    assert outs[0] != outs[1]


def test_stored_logprobs_equal_training_logprobs(word_agent):
    """Rows of different context lengths (left padding while sampling, right padding in
    training), stopping at different lengths, some never stopping."""
    eos = word_agent.stop_ids[0]
    agent = biased(word_agent, {eos: 3.0})  # about one chance in six to stop at each token
    ctx = contexts(agent) * 6
    outs = mgrpo.generate(agent, ctx, 10, seed=5)
    lengths = [len(new) for new, _, _ in outs]
    ended = [e for _, _, e in outs]
    assert any(ended) and not all(ended) and len(set(lengths)) >= 4
    for new, lp, e in outs:
        assert e == (new[-1] == eos) and (e or len(new) == 10) and eos not in new[:-1]
    trajs = [Traj(c + new, [0] * len(c) + [1] * len(new), [0.0] * len(c) + lp) for c, (new, lp, _) in zip(ctx, outs)]
    ids, attn, mask, old = collate(trajs, agent.pad_id, "cpu")
    with torch.no_grad():
        lp = token_logprobs(agent.model, ids, attn)
    m = mask.bool()
    assert m.sum() == sum(lengths)
    assert (lp[m] - old[m]).abs().max() < 1e-5


def test_first_token_frequencies_match_the_softmax(word_agent):
    """A chi-square test over 20,000 draws of the first token, from logits spread far from
    uniform; pad and unk, made the most likely tokens of all, are never drawn; greedy takes
    the argmax of the rest."""
    tok = word_agent.tok
    spread = torch.randn(len(tok), generator=torch.Generator().manual_seed(0)).tolist()
    agent = biased(word_agent, {**dict(enumerate(spread)), tok.pad_token_id: 6.0, tok.unk_token_id: 5.0})
    ctx = contexts(agent)[0]
    n = 20000
    outs = mgrpo.generate(agent, [ctx] * n, 1, seed=11)
    drawn = np.bincount([new[0] for new, _, _ in outs], minlength=agent.model.config.vocab_size)
    with torch.no_grad():
        logits = agent.model(torch.tensor([ctx])).logits[0, -1]
    assert logits.argmax() == tok.pad_token_id
    assert drawn[tok.pad_token_id] == 0 and drawn[tok.unk_token_id] == 0
    p = logits.double().softmax(-1)
    p[[tok.pad_token_id, tok.unk_token_id]] = 0
    p = (p / p.sum()).numpy()
    expected = n * p
    bins = expected >= 5
    rest = ~bins & (p > 0)
    obs, exp = drawn[bins], expected[bins]
    if rest.any():  # rare tokens pooled into one bin
        obs, exp = np.append(obs, drawn[rest].sum()), np.append(exp, expected[rest].sum())
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    # Wilson-Hilferty: the chi-square quantile at p = 0.999 (z = 3.09)
    crit = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < crit, (chi2, crit, dof)
    # and it is not a uniform draw: the frequencies do follow the logits
    uni = np.full(len(obs), n / len(obs))
    assert float(((obs - uni) ** 2 / uni).sum()) > 3 * crit
    # each stored log-prob is the token's under the raw softmax (pad and unk included)
    raw = logits.double().log_softmax(-1)
    for new, lp, _ in outs[:50]:
        assert lp[0] == pytest.approx(raw[new[0]].item(), abs=1e-5)
    greedy = mgrpo.generate(agent, [ctx] * 3, 1, seed=0, greedy=True)
    masked = logits.clone()
    masked[[tok.pad_token_id, tok.unk_token_id]] = -math.inf
    assert [new[0] for new, _, _ in greedy] == [int(masked.argmax())] * 3


def test_same_turns_as_hf_generate_with_a_clean_config(word_agent):
    """A cross-check against a reference decoder: HF `generate`, greedy, with the same suppressed ids and stop
    tokens, writes the same turns (positions, masks and cache of left-padded rows agree), and its raw logits
    give the log-probs ours stored. (Sampled draws use another method than torch.multinomial, whose
    distribution the chi-square test above checks.)"""
    agent = decisive(word_agent)
    ctx = contexts(agent)
    ours = mgrpo.generate(agent, ctx, 8, seed=3, greedy=True)
    L = max(map(len, ctx))
    ids = torch.tensor([[agent.pad_id] * (L - len(c)) + c for c in ctx])
    attn = torch.tensor([[0] * (L - len(c)) + [1] * len(c) for c in ctx])
    out = agent.model.generate(input_ids=ids, attention_mask=attn, generation_config=GenerationConfig(
        max_new_tokens=8, pad_token_id=agent.pad_id, eos_token_id=list(agent.stop_ids), do_sample=False,
        suppress_tokens=list(agent.suppress), output_logits=True, return_dict_in_generate=True))
    new = out.sequences[:, L:]
    lp = torch.stack(out.logits, 1).float().log_softmax(-1).gather(-1, new[..., None])[..., 0]
    assert len({tuple(t) for t, _, _ in ours}) > 1  # turns that differ by context
    for (tokens, logp, _), row, row_lp in zip(ours, new.tolist(), lp.tolist()):
        assert tokens == row[:len(tokens)] and logp == pytest.approx(row_lp[:len(tokens)], abs=1e-6)


def test_a_call_depends_on_its_seed_only(word_agent):
    ctx = contexts(word_agent)
    a = mgrpo.generate(word_agent, ctx, 8, seed=7)
    torch.manual_seed(123)  # the global RNG plays no part
    torch.rand(5)
    assert mgrpo.generate(word_agent, ctx, 8, seed=7) == a
    assert mgrpo.generate(word_agent, ctx, 8, seed=8) != a


def test_static_cache_decoding_equals_the_eager_loop(word_agent):
    """The CUDA-graph path's decoding (a static cache, rows padded to a power of two, finished
    rows kept and masked), run eagerly on the CPU: greedy turns that end at different lengths
    are the eager loop's, token for token, with the same log-probs."""
    eos = word_agent.stop_ids[0]
    agent = decisive(word_agent)
    agent = biased(agent, {eos: 2.0})
    static = copy.deepcopy(agent)
    static.graphs = {}
    ctx = contexts(agent) + contexts(agent, "sub")[:2]  # 7 rows: padded to 8
    for seed in range(2):
        a = mgrpo.generate(agent, ctx, 10, seed, greedy=True)
        b = mgrpo.generate(static, ctx, 10, seed, greedy=True)
        assert [x[0] for x in a] == [x[0] for x in b] and [x[2] for x in a] == [x[2] for x in b]
        for (_, lp_a, _), (_, lp_b, _) in zip(a, b):
            assert lp_a == pytest.approx(lp_b, abs=1e-5)
    assert len({len(x[0]) for x in a}) > 1 and any(x[2] for x in a)
    assert list(static.graphs) == [(8, 256)]
    # sampled, with no row ending early (no stop token is ever drawn), the draws are the same too
    endless = biased(word_agent, {i: -1e4 for i in word_agent.stop_ids})
    c = mgrpo.generate(endless, contexts(word_agent)[:4], 6, seed=1)
    still = copy.deepcopy(endless)
    still.graphs = {}
    assert all(len(x[0]) == 6 for x in c)
    assert [x[0] for x in mgrpo.generate(still, contexts(word_agent)[:4], 6, seed=1)] == [x[0] for x in c]


@pytest.mark.parametrize("which", ["word", "chat"])
def test_kept_conversations_sample_what_whole_contexts_sample(which, word_agent, chat_agent, monkeypatch):
    """Each conversation's KV kept from one turn to the next (and, for the chat model, the shared
    system prompt's KV computed once per set of weights) samples the very tokens that prefilling every
    context whole samples, and stores the log-probs that training recomputes, to 1e-5. Rows stop at
    different steps, and conversations end at different turns. (Word-level contexts are short of
    KEEP_MIN, so they are kept here only with it lowered.)"""
    base = word_agent if which == "word" else chat_agent
    monkeypatch.setattr(sampling, "KEEP_MIN", 0)
    a = biased(base, {base.end[0]: 3.0})  # turns that end at different steps
    ctxs = [prompt_ids(a, "sub", f"city of {p}") for p in toy_tools.PERSONS[:12]]
    kept, alive, early = [Kept() for _ in ctxs], list(range(12)), 0
    for turn in range(4):
        whole = generate(a, [ctxs[j] for j in alive], 10, seed=turn)
        reuse = generate(a, [ctxs[j] for j in alive], 10, seed=turn, kept=[kept[j] for j in alive])
        assert [w[0] for w in whole] == [r[0] for r in reuse]
        assert max(abs(x - y) for w, r in zip(whole, reuse) for x, y in zip(w[1], r[1])) < 1e-5
        trajs = [Traj(ctxs[j] + new, [0] * len(ctxs[j]) + [1] * len(new), [0.0] * len(ctxs[j]) + lp)
                 for j, (new, lp, _) in zip(alive, reuse)]
        ids, attn, mask, old = collate(trajs, a.pad_id, "cpu")
        with torch.no_grad():
            assert ((token_logprobs(a.model, ids, attn) - old) * mask).abs().max() < 1e-5
        early += sum(len(new) < 10 for new, _, _ in reuse)
        for j, (new, _, _) in zip(alive, reuse):
            ctxs[j] = ctxs[j] + new + message_ids(a, "tool", f"result {turn} of {j}")
        alive = [j for i, j in enumerate(alive) if (i + turn) % 3]  # a third of the conversations end
    assert early >= 3 and len(alive) < 12 and all(k.n > 0 for k in kept)
    assert bool(a.prefixes) == (which == "chat")  # a shared prompt of 16 tokens or more gets its cache
    with torch.no_grad():  # new weights: the shared prompt's KV is computed anew, not reused stale
        for p in a.model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    fresh = [prompt_ids(a, "sub", f"city of {p}") for p in toy_tools.PERSONS[:12]]  # the same shared prompt
    assert ([o[0] for o in generate(a, fresh, 10, seed=9)]
            == [o[0] for o in generate(a, fresh, 10, seed=9, kept=[Kept() for _ in fresh])])


@pytest.mark.parametrize("rows_differ", [True, False])
def test_a_shared_prompt_is_scored_once_with_the_same_logprobs_and_gradients(rows_differ, chat_agent):
    """token_logprobs puts a prompt shared by all rows through the model once and repeats its KV:
    log-probs and gradients equal those of each row scored alone (no sharing) to 1e-5, for
    right-padded rows of different lengths and for identical rows; with gradient checkpointing
    (which drops caches) it scores the rows whole, with the same results."""
    a = copy.deepcopy(chat_agent)
    rows = [prompt_ids(a, "sub", f"city of {p if rows_differ else 'ada'}") + message_ids(a, "tool", "x " * i * rows_differ)
            for i, p in enumerate(toy_tools.PERSONS[:6])]
    ids, attn, _, _ = collate([Traj(r, [0] * len(r), [0.0] * len(r)) for r in rows], a.pad_id, "cpu")
    weights = torch.rand(ids.shape) * attn  # a loss that reads every position
    calls = []
    a.model.get_decoder().register_forward_hook(lambda module, inputs, out: calls.append(1))

    def scored(batched):
        a.model.zero_grad()
        calls.clear()
        if batched:
            lp = token_logprobs(a.model, ids, attn)
        else:
            lp = torch.cat([token_logprobs(a.model, ids[b:b + 1], attn[b:b + 1]) for b in range(len(ids))])
        (lp * weights).sum().backward()
        return lp.detach(), [p.grad.clone() for p in a.model.parameters() if p.requires_grad], len(calls)

    a.model.train()
    (alone, g_alone, _), (shared, g_shared, n_calls) = scored(False), scored(True)
    assert n_calls == 2  # the shared prompt on one row, then the rest of every row
    assert ((alone - shared).abs().max()) < 1e-5 and (shared != 0).sum() > 0
    assert max(float((x - y).abs().max() / x.abs().max()) for x, y in zip(g_alone, g_shared)) < 1e-5
    checkpoint_activations(a.model, "the chat model")
    a.model.train()
    ckpt, g_ckpt, n_calls = scored(True)
    assert n_calls == 1 and (ckpt - alone).abs().max() < 1e-5
    assert max(float((x - y).abs().max() / x.abs().max()) for x, y in zip(g_alone, g_ckpt)) < 1e-5


def test_a_kept_cache_as_long_as_its_context_is_a_clear_error(word_agent, monkeypatch):
    """A Kept handed with another conversation than its own (here: one no longer than what it holds)
    stops with a message, not a shape error deep in the model or a silently wrong turn; contexts
    shorter than KEEP_MIN on average keep nothing."""
    ctx = contexts(word_agent)[:2]
    kept = [Kept() for _ in ctx]
    generate(word_agent, ctx, 4, seed=0, kept=kept)
    assert [k.n for k in kept] == [0, 0]
    monkeypatch.setattr(sampling, "KEEP_MIN", 0)
    kept = [Kept() for _ in ctx]
    generate(word_agent, ctx, 4, seed=0, kept=kept)
    with pytest.raises(ValueError, match="kept KV cache"):
        generate(word_agent, ctx, 4, seed=0, kept=kept)


@pytest.mark.parametrize("shared", [True, False])
def test_logprobs_only_where_the_mask_reads_them(shared, chat_agent):
    """token_logprobs with a loss mask runs the head only at its 1s: the same log-probs there (1e-5)
    and 0 elsewhere, the same gradients, with and without a prompt shared by all rows."""
    a = copy.deepcopy(chat_agent)
    rows = [prompt_ids(a, "sub", f"city of {p}")[0 if shared else i:] + message_ids(a, "tool", "x " * i)
            for i, p in enumerate(toy_tools.PERSONS[:5])]
    ids, attn, _, _ = collate([Traj(r, [0] * len(r), [0.0] * len(r)) for r in rows], a.pad_id, "cpu")
    mask = (torch.rand(ids.shape, generator=torch.Generator().manual_seed(0)) < 0.3).long() * attn
    weights = torch.rand(ids.shape)

    def scored(m):
        a.model.zero_grad()
        lp = token_logprobs(a.model, ids, attn, m) * mask
        (lp * weights).sum().backward()
        return lp.detach(), [p.grad.clone() for p in a.model.parameters() if p.requires_grad]

    (full, g_full), (part, g_part) = scored(None), scored(mask)
    assert (full - part).abs().max() < 1e-5 and (part != 0).sum() == (mask[:, 1:] * attn[:, :-1]).sum()
    assert max(float((x - y).abs().max() / x.abs().max()) for x, y in zip(g_full, g_part)) < 1e-5
    assert (token_logprobs(a.model, ids, attn, mask)[mask == 0] == 0).all()


def test_a_slab_cache_gives_a_dynamic_caches_logits(chat_agent):
    """The sampler's KV cache written in place (Slab) against transformers' DynamicCache: the same logits after
    a left-padded prefill, decode steps, and rows leaving the batch between them."""
    import transformers
    a = chat_agent
    ctx = contexts(a, "sub")
    ids, attn = sampling.left_pad(ctx, a.pad_id, len(ctx), "cpu")
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    slab = sampling.new_cache(a.model, ids.shape[1] + 4)
    assert all(type(layer) is sampling.Slab for layer in slab.layers)
    outs = []
    for cache in (slab, transformers.DynamicCache(config=a.model.config)):
        with torch.no_grad():
            logits, m, p, rows = [sampling.forward_last(a.model, ids, attn, pos, cache)], attn, pos[:, -1:] + 1, ctx
            for t in range(4):
                tok = logits[-1].argmax(-1)[:, None]
                if t == 2:  # two rows leave
                    keep = torch.tensor([0, 2, 3])
                    cache.batch_select_indices(keep)
                    m, p, tok = m[keep], p[keep], tok[keep]
                m = torch.cat([m, m.new_ones(len(m), 1)], 1)
                logits.append(sampling.forward_last(a.model, tok, m, p + t, cache))
        outs.append(logits)
    for x, y in zip(*outs):
        assert torch.allclose(x, y, atol=1e-5)
    assert slab.layers[0].keys.shape[2] == ids.shape[1] + 4 == slab.layers[0].capacity


def test_the_head_reads_the_last_states_as_rows_and_gives_the_models_logits(chat_agent):
    """forward_last hands the head the last position of each row as a 2-D [B, H] tensor, never a strided
    [B, 1, H] slice (which torch multiplies by copying the head's weight per row: 0.9 s at 8 rows of SmolLM2 in
    bf16), and its logits are the model's own at the last position of a left-padded prefill."""
    a = chat_agent
    ctx = contexts(a, "sub")
    ids, attn = sampling.left_pad(ctx, a.pad_id, len(ctx), "cpu")
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    seen = []
    hook = a.model.get_output_embeddings().register_forward_pre_hook(lambda m, x: seen.append(x[0]))
    try:
        with torch.no_grad():
            last = sampling.forward_last(a.model, ids, attn, pos, sampling.new_cache(a.model, ids.shape[1]))
    finally:
        hook.remove()
    assert ids.shape[1] > 1 and len(seen) == 1 and seen[0].dim() == 2 and seen[0].stride(-1) == 1
    with torch.no_grad():
        full = a.model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -1]
    assert last.shape == full.shape and torch.allclose(last, full, atol=1e-5)


def test_a_model_with_sliding_windows_decodes_with_transformers_cache():
    """A model whose layers are not all full attention (sliding windows) gets transformers' own cache."""
    import transformers
    cfg = transformers.Qwen2Config(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=32, use_sliding_window=True,
                                   sliding_window=4, max_window_layers=0)
    cache = sampling.new_cache(transformers.Qwen2ForCausalLM(cfg), 64)
    assert type(cache) is transformers.DynamicCache and type(cache.layers[0]) is not sampling.Slab


@pytest.mark.parametrize("which", ["word", "chat"])
def test_finished_rows_that_ride_along_change_nothing(which, word_agent, chat_agent, monkeypatch):
    """Rows that ended their turn stay in the batch until they are sampling.LEAVE of it: greedy turns, their
    log-probs and each conversation's kept KV are the same whether finished rows leave at once, at half the
    batch, or never; the next turn from the kept KV is the whole context's."""
    a = decisive(word_agent if which == "word" else chat_agent)
    monkeypatch.setattr(sampling, "KEEP_MIN", 0)
    a = biased(a, {a.end[0]: 2.0})
    ctxs = [prompt_ids(a, "sub", f"city of {p}") for p in toy_tools.PERSONS[:10]]
    results = {}
    for leave in (1e-9, 0.5, 1.0):
        monkeypatch.setattr(sampling, "LEAVE", leave)
        kept = [Kept() for _ in ctxs]
        first = generate(a, ctxs, 10, seed=0, greedy=True, kept=kept)
        after = [c + new + message_ids(a, "tool", "result") for c, (new, _, _) in zip(ctxs, first)]
        second = generate(a, after, 10, seed=1, greedy=True, kept=kept)
        results[leave] = (first, second)
        whole = generate(a, after, 10, seed=1, greedy=True)
        assert [o[0] for o in second] == [o[0] for o in whole]
        assert max(abs(x - y) for s, w in zip(second, whole) for x, y in zip(s[1], w[1])) < 1e-5
        # kept: the context and the turn's tokens, its stop token too where the row rode along past it
        assert all(len(c) + len(new) - 1 <= k.n <= len(c) + len(new) for c, (new, _, _), k in zip(after, second, kept))
    (f0, s0), *others = results.values()
    assert len({len(new) for new, _, _ in f0}) > 1  # rows ended at different steps
    for f, s in others:
        assert [o[0] for o in f] == [o[0] for o in f0] and [o[0] for o in s] == [o[0] for o in s0]
        for x, y in zip(f + s, f0 + s0):
            assert x[1] == pytest.approx(y[1], abs=1e-5)


def test_probabilities_that_are_not_finite_stop_the_draw(word_agent):
    """A model whose logits hold NaN or inf, or whose every allowed token is at -inf, is broken: the draw says
    so instead of returning a token (torch.multinomial raised too)."""
    gen, none = torch.Generator().manual_seed(0), torch.tensor([], dtype=torch.long)
    for bad in (float("nan"), float("inf")):
        logits = torch.zeros(2, 6)
        logits[1, 3] = bad
        with pytest.raises(FloatingPointError, match="not finite or all 0"):
            sampling.sample_token(logits, none, gen)
    with pytest.raises(FloatingPointError):
        sampling.sample_token(torch.tensor([[0.0, -math.inf]]), torch.tensor([0]), gen)
    tok, lp = sampling.sample_token(torch.tensor([[0.0, 5.0, -math.inf]] * 3), torch.tensor([1]), gen)
    assert tok.tolist() == [0, 0, 0] and lp.tolist() == pytest.approx([-5.0067] * 3, abs=1e-4)
