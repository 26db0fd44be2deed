"""bf16 (--dtype): where it is chosen, the bf16 copy that samples, and how training accounts for the sampler's
log-probs not being its own (mgrpo.truncated_is_weight). On tiny models, which run bf16 on any CPU (slowly
where the CPU has no bf16 instructions); tests/test_smollm2.py runs the real model in bf16."""
import copy
import random

import pytest
import torch

import agents
import helpers
import mgrpo
import run
import sampling
import toy_tools
from cold_start import encode_demo


@pytest.fixture(scope="module")
def bf16_agent():
    return helpers.load_agent("", mgrpo.parse_args(["--chat", "--model-size", "0.1M", "--dtype", "bfloat16"]), seed=0)


def test_auto_picks_bf16_for_a_large_model_where_the_device_multiplies_bf16_fast(monkeypatch):
    here = agents.cpu_flags()  # this machine's, read from /proc/cpuinfo
    assert here == set() or "fpu" in here
    big, small = torch.nn.Linear(4000, 4000), torch.nn.Linear(100, 100)  # 16M and 0.01M parameters
    for flags, fast in (({"avx2", "amx_bf16", "amx_tile"}, True), ({"avx512f", "avx512_bf16"}, True), ({"avx2"}, False)):
        monkeypatch.setattr(agents, "cpu_flags", lambda: flags)
        assert bool(agents.bf16_hardware("cpu")) is fast
        assert agents.use_bf16("auto", big, "cpu") is fast and agents.use_bf16("auto", small, "cpu") is False
        assert agents.use_bf16("bfloat16", small, "cpu") and not agents.use_bf16("float32", big, "cpu")


@pytest.mark.parametrize("flags", [set(), {"amx_bf16"}])
def test_the_start_up_plan_says_each_agents_precision_and_warns_of_slow_bf16(flags, bf16_agent, monkeypatch, capsys):
    monkeypatch.setattr(agents, "cpu_flags", lambda: flags)
    args = mgrpo.parse_args(["--chat", "--model-size", "0.1M", "--dtype", "bfloat16", "--role", "main",
                             "--store", "unused"])
    run.print_plan(args, {"main": bf16_agent}, "out")
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("precision:"))
    assert "main bf16 matmuls over fp32 weights and AdamW, sampling from a bf16 copy" in line
    assert ("warning" in line) == (not flags) and ("amx_bf16" in line) == bool(flags)


def test_the_sampler_is_a_bf16_copy_refreshed_whenever_a_weight_changes(bf16_agent):
    a = copy.deepcopy(bf16_agent)
    model = sampling.sampler(a)
    assert model is not a.model and all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(b.dtype == torch.float32 for b in model.buffers() if b.is_floating_point())  # rotary stays fp32
    assert all(torch.equal(q, p.to(torch.bfloat16)) for q, p in zip(model.parameters(), a.model.parameters()))
    with torch.no_grad():
        next(a.model.parameters()).add_(0.5)  # as an optimizer step writes weights in place
    assert sampling.sampler(a) is model  # the same copy, written in place (a CUDA graph keeps its addresses)
    assert all(torch.equal(q, p.to(torch.bfloat16)) for q, p in zip(model.parameters(), a.model.parameters()))
    fp32 = helpers.load_agent("", mgrpo.parse_args(["--chat", "--model-size", "0.1M"]), seed=0)
    assert not fp32.bf16 and sampling.sampler(fp32) is fp32.model
    agents.add_adapter(a, 4, "base")  # LoRA: the base is bf16 itself, and the copy without adapters goes
    assert a.copy is None and sampling.sampler(a) is a.model and next(a.model.parameters()).dtype == torch.bfloat16


def demos(agent, n=4):
    qs = [toy_tools.make_question(s, 1) for s in range(n)]
    return [encode_demo(agent, toy_tools.sub_demo(q, random.Random(s), 0.0, chat=True), "sub") for s, q in enumerate(qs)]


@pytest.mark.parametrize("bf16", [True, False])
def test_bf16_training_uses_its_own_old_logprobs_and_truncated_is_weights(bf16, bf16_agent, monkeypatch):
    """In bf16 the batch's old log-probs (eq. 14-19) are training's own at the weights that sampled, and each
    token's term is weighted by min(pi_old / pi_sampler, 2); in fp32 the stored sampling log-probs are the old
    ones (they are training's, to 1e-5), unweighted. The update logs the gap."""
    a = copy.deepcopy(bf16_agent)
    a.bf16 = bf16
    args = mgrpo.parse_args(["--chat", "--model-size", "0.1M", "--dtype", "bfloat16" if bf16 else "float32"])
    trajs = demos(a)
    ids, attn, mask, _ = sampling.collate(trajs, a.pad_id, "cpu")
    with torch.no_grad(), a.autocast():
        own = sampling.token_logprobs(a.model, ids, attn, mask)
    shift = torch.zeros_like(own)
    shift[:, ::3] = 1.5  # the sampler found these tokens e^1.5 times less likely than training does: capped at 2
    shift[:, 1::3] = -0.3  # these e^0.3 times more likely
    for t, row, s in zip(trajs, own, shift):
        t.logp = ((row - s) * torch.tensor(t.mask + [0] * (len(row) - len(t.mask)))).tolist()[:len(t.ids)]
    seen = []
    real = mgrpo.policy_loss

    def spy(logp, old, adv, mask, *rest, is_weight=None, **kw):
        seen.append((old.clone(), None if is_weight is None else is_weight.clone(), mask))
        return real(logp, old, adv, mask, *rest, is_weight=is_weight, **kw)
    monkeypatch.setattr(mgrpo, "policy_loss", spy)
    stats = mgrpo.update_agent(a, trajs, torch.tensor([1.0, -1.0, 0.5, -0.5]), args)
    (old, w, m), = seen
    stored = sampling.collate(trajs, a.pad_id, "cpu")[3]
    if not bf16:
        assert torch.equal(old, stored) and w is None and "logp_gap" not in stats
        return
    on = m.bool()
    assert torch.allclose(old[on], own[on], atol=1e-6)  # training's own, not the sampler's
    expect = torch.exp(shift).clamp(max=mgrpo.IS_CAP)
    assert torch.allclose(w[on], expect[on], atol=1e-4) and (w[~on] == 0).all()
    capped = float((shift[on] == 1.5).float().mean())
    assert stats["is_capped"] == pytest.approx(capped, abs=1e-6) and stats["logp_gap_max"] == pytest.approx(1.5, abs=1e-4)
    assert stats["logp_gap"] == pytest.approx(float(shift[on].abs().mean()), abs=1e-4)
    assert stats["approx_kl"] == pytest.approx(0.0, abs=1e-7)  # one epoch: the ratio is exactly 1


def test_a_bf16_run_trains_and_logs_the_samplers_gap(tmp_path, monkeypatch):
    """Two M-GRPO steps of the tiny chat models in bf16, no cold start: the sampler's log-probs are within a
    bf16 rounding of training's on average (it samples from the bf16 copy, training runs autocast)."""
    samplers, real = [], sampling.sampler
    monkeypatch.setattr(sampling, "sampler", lambda a: samplers.append(next(real(a).parameters()).dtype) or real(a))
    s = mgrpo.main(["--chat", "--model-size", "0.1M", "--dtype", "bfloat16", "--cold-start", "0", "--steps", "2",
                    "--questions-per-step", "2", "--group-size", "2", "--max-new-tokens", "12", "--eval-questions", "2",
                    "--out", str(tmp_path)])
    rows = [r for r in map(__import__("json").loads, open(tmp_path / "metrics.jsonl")) if "eval" not in r]
    assert s["steps"] == 2 and len(rows) == 2 and samplers and set(samplers) == {torch.bfloat16}
    for r in rows:
        assert 0 < r["logp_gap_main"] < 0.1 and r["logp_gap_max_main"] >= r["logp_gap_main"]
        assert r["grad_norm_main"] is not None
