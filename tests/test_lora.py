"""--lora-rank: a frozen base and an adapter per agent (peft). Only the adapters train, sampling and
scoring agree with the adapters on, the KL reference is the base with the adapter off, one base can
serve both agents, and a LoRA run saves, resumes and loads back with peft alone."""
import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

import cold_start
import helpers
import mgrpo
import toy_tools
from agents import Traj, add_adapter, prompt_ids, share_base
from sampling import collate, generate, token_logprobs

CHAT = ["--chat", "--model-size", "0.1M", "--cold-start", "0", "--max-new-tokens", "12", "--lora-rank", "4"]
SHORT = ["--steps", "4", "--questions-per-step", "4", "--group-size", "4", "--eval-questions", "8",
         "--eval-every", "2", "--lora-rank", "4", "--lr", "3e-3"]


def adapted(args, seed=0, name=""):
    """An agent with a LoRA adapter whose B matrices are random (peft starts them at 0, a no-op)."""
    agent = helpers.load_agent(name, args, seed)
    add_adapter(agent, args.lora_rank, name or "built-in-test")
    g = torch.Generator().manual_seed(seed)
    for n, p in agent.model.named_parameters():
        if "lora_B" in n:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return agent


def sampled_trajs(agent, n=4):
    ctx = [prompt_ids(agent, "sub", f"city of {p}") for p in toy_tools.PERSONS[:n]]
    outs = generate(agent, ctx, agent.max_new, seed=3)
    return [Traj(c + new, [0] * len(c) + [1] * len(new), [0.0] * len(c) + lp) for c, (new, lp, _) in zip(ctx, outs)]


def test_only_the_adapter_trains_and_the_sampled_logprobs_are_the_scored_ones():
    args = mgrpo.parse_args(CHAT)
    agent = adapted(args)
    frozen = {n: p.detach().clone() for n, p in agent.model.named_parameters() if not p.requires_grad}
    trained = {n: p.detach().clone() for n, p in agent.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained) and all(p.dtype == torch.float32 for p in trained.values())
    assert sum(p.numel() for g in agent.opt.param_groups for p in g["params"]) == sum(p.numel() for p in trained.values())
    trajs = sampled_trajs(agent)
    ids, attn, mask, old = collate(trajs, agent.pad_id, "cpu")
    with torch.no_grad():
        lp = token_logprobs(agent.model, ids, attn)
    assert mask.sum() > 8 and (lp - old)[mask.bool()].abs().max() < 1e-5
    mgrpo.update_agent(agent, trajs, torch.tensor([1.0, -1.0, 0.5, -0.5]), args)
    now = dict(agent.model.named_parameters())
    assert all(torch.equal(now[n], p) for n, p in frozen.items())
    assert all(not torch.equal(now[n], p) for n, p in trained.items() if "lora_A" in n)


def test_the_kl_reference_is_the_base_with_the_adapter_off(monkeypatch):
    args = mgrpo.parse_args(CHAT + ["--kl-coef", "0.1"])
    plain = helpers.load_agent("", args, 0)
    agent = adapted(args)
    trajs = sampled_trajs(agent)
    ids, attn, mask, _ = collate(trajs, agent.pad_id, "cpu")
    with torch.no_grad():
        want = token_logprobs(plain.model, ids, attn, mask)
        on = token_logprobs(agent.model, ids, attn, mask)
    seen = []
    real = mgrpo.policy_loss
    monkeypatch.setattr(mgrpo, "policy_loss", lambda *a, **k: seen.append(k["ref_logp"]) or real(*a, **k))
    mgrpo.update_agent(agent, trajs, torch.tensor([1.0, -1.0, 0.5, -0.5]), args)
    assert agent.ref is None and (seen[0] - want).abs().max() < 1e-5 and (on - want).abs().max() > 1e-2


def test_one_base_two_adapters_and_one_update_leaves_the_other_agent_alone(tmp_path):
    args = mgrpo.parse_args(CHAT)
    base = helpers.load_agent("", args, 0)
    base.model.save_pretrained(tmp_path)
    base.tok.save_pretrained(tmp_path)
    agents = {"main": adapted(args, 1, str(tmp_path)), "sub": adapted(args, 2, str(tmp_path))}
    share_base(agents)
    mp, sp = dict(agents["main"].model.named_parameters()), dict(agents["sub"].model.named_parameters())
    assert all((mp[n] is p) == (not p.requires_grad) for n, p in sp.items())  # the base once, adapters twice
    trajs = sampled_trajs(agents["sub"])
    ids, attn, mask, _ = collate(trajs, agents["sub"].pad_id, "cpu")
    with torch.no_grad():
        sub_before, main_before = (token_logprobs(agents[n].model, ids, attn) for n in ("sub", "main"))
    mgrpo.update_agent(agents["main"], trajs, torch.tensor([1.0, -1.0, 0.5, -0.5]), args)
    with torch.no_grad():
        sub_after, main_after = (token_logprobs(agents[n].model, ids, attn) for n in ("sub", "main"))
    assert torch.equal(sub_before, sub_after) and (main_before - main_after).abs().max() > 1e-4
    other = {"main": adapted(args, 1, str(tmp_path)), "sub": adapted(args, 2)}  # another base
    with pytest.raises(ValueError, match="bases differ"):
        share_base(other)
    # a run shares the base where both agents put adapters on one given base in one process, and only there
    same = ["--main-model", str(tmp_path), "--sub-model", str(tmp_path), "--lora-rank", "4"]
    two = {"main": None, "sub": None}
    assert cold_start.one_base(mgrpo.parse_args(same), two)
    assert not cold_start.one_base(mgrpo.parse_args(same), {"main": None})  # --role main: S is elsewhere
    assert not cold_start.one_base(mgrpo.parse_args(same + ["--cold-start", "3"]), two)  # each base trained apart
    assert not cold_start.one_base(mgrpo.parse_args(same[:2] + same[4:]), two)  # one given base, one built
    assert not cold_start.one_base(mgrpo.parse_args(same[:-2]), two)  # no LoRA
    out = str(tmp_path / "run")  # and a run with it
    mgrpo.main(same + ["--steps", "1", "--questions-per-step", "2", "--group-size", "2", "--eval-questions", "2",
                       "--eval-every", "0", "--max-new-tokens", "12", "--out", out])
    assert os.path.isfile(os.path.join(out, "sub", "adapter_model.safetensors"))


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith("t_") and "per_s" not in k}
                for line in f]


def test_a_built_base_is_saved_and_the_final_adapters_load_with_peft_alone(tmp_path):
    """Models built here train whole in the cold start; their adapters come after it, over a base saved
    to <out>/base, which the adapters name: the final save loads with peft alone, the base unchanged."""
    from peft import AutoPeftModelForCausalLM
    out = str(tmp_path / "run")
    mgrpo.main(["--steps", "1", "--cold-start", "5", "--questions-per-step", "2", "--group-size", "2",
                "--eval-questions", "2", "--eval-every", "0", "--lora-rank", "4", "--out", out])
    args = mgrpo.parse_args(["--lora-rank", "4"])
    for n in ("main", "sub"):
        agent = helpers.load_agent(os.path.join(out, n), args)  # as a checkpoint is loaded
        peft_alone = AutoPeftModelForCausalLM.from_pretrained(os.path.join(out, n))
        ids = torch.tensor([prompt_ids(agent, n, "country of ada ?")])
        with torch.no_grad():
            assert torch.allclose(agent.model(ids).logits, peft_alone(ids).logits, atol=1e-6)
        base = AutoModelForCausalLM.from_pretrained(os.path.join(out, "base", n)).state_dict()
        frozen = {k.replace("base_layer.", ""): p for k, p in agent.model.named_parameters() if not p.requires_grad}
        assert frozen.keys() == base.keys() and all(torch.equal(frozen[k], base[k]) for k in base)
        assert all("lora_" in k for k, p in agent.model.named_parameters() if p.requires_grad)


def test_a_lora_run_resumes_as_if_never_stopped(tmp_path, monkeypatch, cold_start_dir):
    """Over given bases (the trained cold start): killed after step 2 and resumed, the same metrics as
    a run never stopped, and the adapters trained."""
    given = ["--main-model", cold_start_dir["main"], "--sub-model", cold_start_dir["sub"]]
    whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
    mgrpo.main(SHORT + given + ["--out", whole])
    real = mgrpo.train_step

    def killed_at_step_3(*a, **kw):
        if a[2] == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)
    monkeypatch.setattr(mgrpo, "train_step", killed_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        mgrpo.main(SHORT + given + ["--out", cut])
    monkeypatch.undo()
    mgrpo.main(SHORT + given + ["--out", cut, "--resume"])
    assert metrics(cut) == metrics(whole) and len(metrics(whole)) == 4 + 5
    assert not os.path.exists(os.path.join(whole, "base"))  # given bases are named, not copied
    agent = helpers.load_agent(os.path.join(whole, "sub"), mgrpo.parse_args(SHORT + given))
    assert max(p.abs().max() for n, p in agent.model.named_parameters() if "lora_B" in n) > 0


@pytest.mark.parametrize("config", ["{not json", '{"peft_type": "LORA", "base_model_name_or_path": 7}', "[]"])
def test_a_garbage_adapter_config_is_an_error_not_a_crash_of_the_interpreter(tmp_path, config):
    """A checkpoint folder's adapter_config.json can hold anything: loading it raises (and a resume then
    tries the checkpoint before), it never runs code or loads some other model."""
    args = mgrpo.parse_args(CHAT)
    agent = helpers.load_agent("", args)
    agent.tok.save_pretrained(tmp_path)
    (tmp_path / "adapter_config.json").write_text(config)
    with pytest.raises(Exception) as e:
        helpers.load_agent(str(tmp_path), args)
    assert not isinstance(e.value, (SystemExit, KeyboardInterrupt))


def test_the_start_up_estimate_counts_the_adapters_to_come():
    """Printed before the adapters exist, the estimate for --lora-rank equals the one for the agent with
    its adapters in place: the frozen base at its size, 16 bytes a trained parameter, no reference."""
    from run import memory_estimate
    args = mgrpo.parse_args(CHAT + ["--kl-coef", "0.1"])
    agent = helpers.load_agent("", args)
    full = memory_estimate(agent, 100, 4, reference=True)[0]
    before = memory_estimate(agent, 100, 4, reference=True, lora=4)[0]
    add_adapter(agent, args.lora_rank, "built-in-test")
    after = memory_estimate(agent, 100, 4, reference=True)[0]
    adapters = sum(p.numel() for p in agent.model.parameters() if p.requires_grad)
    assert before == after and after * 2 ** 30 == 4 * (sum(p.numel() for p in agent.model.parameters()) - adapters) \
        + 16 * adapters and after < full


def test_the_estimate_counts_what_the_layers_save_for_backward():
    """The micro-batch term of the start-up estimate against the bytes that a training forward saves
    for backward (counted by autograd's hooks), on a Qwen2 with an MLP 5.4 x hidden as Qwen2.5's: the
    same within 25%, so the estimate neither hides activations nor counts them twice."""
    import transformers
    from agents import Agent
    from run import memory_estimate
    from sampling import token_logprobs
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        hidden_size=64, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=300, tie_word_embeddings=True))
    rows, tokens, sampled = 4, 256, 16
    ids = torch.randint(0, 300, (rows, tokens))
    mask = torch.zeros_like(ids)
    mask[:, -sampled:] = 1
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(model, ids, torch.ones_like(ids), mask)
    batch = memory_estimate(Agent(model, None), tokens, rows, sampled=sampled)[1] * 2 ** 30
    assert 0.75 < batch / sum(saved.values()) < 1.25, (batch, sum(saved.values()))
