"""Hand-checked cases for the pure functions: rewards, advantages, alignment, loss."""
import math
import random
from collections import Counter

import pytest
import torch

import mgrpo
from mgrpo import align_sub_trajectories, group_advantages, main_reward, paper_D, policy_loss, sub_reward


def test_rewards_eq_4_5():
    assert main_reward(True, True) == pytest.approx(1.0)
    assert main_reward(True, False) == pytest.approx(0.1)
    assert main_reward(False, True) == 0.0
    assert sub_reward(True, True, 1.0) == pytest.approx(1.0)
    assert sub_reward(True, False, 1.0) == pytest.approx(0.6)
    assert sub_reward(True, True, 0.0) == pytest.approx(0.5)
    assert sub_reward(False, True, 1.0) == 0.0


def test_group_advantages_by_hand():
    # mean 0.25, population std sqrt(0.1875) = 0.4330
    a = group_advantages([1.0, 0.0, 0.0, 0.0])
    r3 = 1 / math.sqrt(3)
    assert a.tolist() == pytest.approx([math.sqrt(3), -r3, -r3, -r3], rel=1e-4)
    # population, not sample, std: [0, 1] -> [-1, 1] (the sample std would give +-0.707)
    assert group_advantages([0.0, 1.0]).tolist() == pytest.approx([-1.0, 1.0], rel=1e-4)


def test_group_advantages_zero_variance_and_batches():
    a = group_advantages([[0.1] * 8, [1.0, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1], [0.0] * 8])
    assert torch.isfinite(a).all()
    assert a[0].abs().max() == 0 and a[2].abs().max() == 0
    assert a[1, 0] > 0 and a[1].sum().abs() < 1e-5
    assert group_advantages([5.0]).tolist() == [0.0]  # a group of one has no baseline


def test_the_collapse_alarm_holds_while_a_signature_lasts_ALARM_STEPS_steps():
    from report import ALARM_STEPS, alarms
    streaks, seen = {}, {}
    for step in range(3 * ALARM_STEPS):
        rec = {"zero_var_main": 1.0 if step != ALARM_STEPS // 2 else 0.5, "zero_var_sub": 1.0, "success": 0.0,
               "d_k": [0, 0, 1, 0] if step < 2 * ALARM_STEPS else [0, 0, 0, 0]}
        for key in alarms(streaks, rec):
            seen.setdefault(key, []).append(step)
    # S flat from the start; M's streak broken once, so its alarm comes later; no delegation in the last third
    assert seen == {"flat_sub": list(range(ALARM_STEPS - 1, 3 * ALARM_STEPS)),
                    "flat_main": list(range(ALARM_STEPS // 2 + ALARM_STEPS, 3 * ALARM_STEPS)),
                    "no_delegation": [3 * ALARM_STEPS - 1]}
    assert alarms({}, {"step": 1, "eval": "sampled", "zero_var_main": 1.0}) == []  # an evaluation's line
    streaks = {}
    for _ in range(ALARM_STEPS):  # the single agent delegates nothing by design
        found = alarms(streaks, {"zero_var_main": 0.5, "d_k": [0, 0]}, delegates=False)
    assert found == [] and "no_delegation" not in streaks


def test_align_worked_example():
    # K = 4 rollouts delegating 0, 1, 2 and 4 times, D = 2
    pairs = align_sub_trajectories([0, 1, 2, 4], 2, random.Random(0))
    assert len(pairs) == 8
    slots = [pairs[j * 2:(j + 1) * 2] for j in range(4)]
    # d_k = 0: filled from the siblings' sub-trajectories
    assert all(k != 0 and i < [0, 1, 2, 4][k] for k, i in slots[0])
    assert slots[1] == [(1, 0), (1, 0)]           # d_k = 1 < D: kept and duplicated
    assert slots[2] == [(2, 0), (2, 1)]           # d_k = D: kept as is
    assert len(set(slots[3])) == 2 and all(k == 3 for k, _ in slots[3])  # d_k > D: D distinct


def test_align_no_delegation_and_sizes():
    assert align_sub_trajectories([0, 0, 0], 3, random.Random(0)) == []
    rng = random.Random(1)
    for _ in range(200):
        counts = [rng.randrange(0, 6) for _ in range(8)]
        pairs = align_sub_trajectories(counts, 3, rng)
        if sum(counts) == 0:
            assert pairs == []
            continue
        assert len(pairs) == 3 * 8
        for k, d in enumerate(counts):
            own = pairs[3 * k:3 * (k + 1)]
            assert all(i < counts[kk] for kk, i in own)
            if d >= 3:
                assert len(set(own)) == 3 and all(kk == k for kk, _ in own)
            elif d > 0:
                assert set(own) == {(k, i) for i in range(d)}


def test_align_is_uniform():
    # d_k > D keeps each of its own with probability D / d_k; the d_k = 0 slot draws
    # uniformly from the siblings' pool
    rng = random.Random(2)
    kept, filled = Counter(), Counter()
    n = 4000
    for _ in range(n):
        pairs = align_sub_trajectories([4, 0, 2], 2, rng)
        kept.update(i for _, i in pairs[:2])
        filled.update(pairs[2:4])
    for i in range(4):
        assert abs(kept[i] / n - 0.5) < 0.04
    for p in [(0, 0), (0, 1), (0, 2), (0, 3), (2, 0), (2, 1)]:
        assert abs(filled[p] / (2 * n) - 1 / 6) < 0.02


def test_paper_D():
    assert paper_D([2] * 99 + [5]) == 2
    assert paper_D([2] * 98 + [5, 5]) == 5
    assert paper_D([0, 1, 2, 3]) == 3


def test_policy_loss_by_hand():
    mask = torch.tensor([[1, 1, 0]])
    old = torch.zeros(1, 3)
    # ratio 1: loss = -A
    loss, st = policy_loss(torch.zeros(1, 3), old, torch.tensor([2.0]), mask)
    assert loss.item() == pytest.approx(-2.0) and st["clip_frac"] == 0
    # ratio 1.5 with A > 0 is clipped at 1 + eps_high = 1.28
    lp = torch.full((1, 3), math.log(1.5))
    loss, st = policy_loss(lp, old, torch.tensor([1.0]), mask)
    assert loss.item() == pytest.approx(-1.28) and st["clip_frac"] == 1
    # ratio 0.5 with A < 0: min(-0.5, -0.8) = -0.8, clipped; with A > 0 not clipped
    lp = torch.full((1, 3), math.log(0.5))
    loss, st = policy_loss(lp, old, torch.tensor([-1.0]), mask)
    assert loss.item() == pytest.approx(0.8) and st["clip_frac"] == 1
    loss, st = policy_loss(lp, old, torch.tensor([1.0]), mask)
    assert loss.item() == pytest.approx(-0.5) and st["clip_frac"] == 0
    # asymmetric range is configurable
    loss, _ = policy_loss(torch.full((1, 3), math.log(1.5)), old, torch.tensor([1.0]), mask, eps_high=0.2)
    assert loss.item() == pytest.approx(-1.2)


def test_policy_loss_aggregation():
    # sequence 0 has 1 token (A = 1), sequence 1 has 3 tokens (A = -1), ratio 1
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    z = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -1.0])
    seq, _ = policy_loss(z, z, adv, mask, agg="seq-mean")
    tok, _ = policy_loss(z, z, adv, mask, agg="token-mean")
    assert seq.item() == pytest.approx(0.0)           # (-1 + 1) / 2
    assert tok.item() == pytest.approx(0.5)           # (-1 + 3) / 4
    with pytest.raises(ValueError):
        policy_loss(z, z, adv, mask, agg="sum")


def test_masked_tokens_get_no_gradient():
    torch.manual_seed(0)
    lp = (torch.randn(3, 6) - 2).requires_grad_()
    old = lp.detach() + 0.05 * torch.randn(3, 6)  # ratios inside the clip range
    mask = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0], [0, 0, 0, 1, 0, 0]])
    loss, _ = policy_loss(lp, old, torch.tensor([1.0, -0.5, 2.0]), mask)
    loss.backward()
    assert (lp.grad[mask == 0] == 0).all()
    assert (lp.grad[mask == 1] != 0).all()
    # what stands at masked positions cannot change the loss
    old2 = old.clone()
    old2[mask == 0] = 50.0
    loss2, _ = policy_loss(lp, old2, torch.tensor([1.0, -0.5, 2.0]), mask)
    assert loss2.item() == pytest.approx(loss.item())


def test_kl_to_reference_is_k3_and_pulls_towards_the_reference():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0, -3.0]])
    mask, adv = torch.tensor([[1, 1, 0]]), torch.tensor([0.0])  # no policy-gradient signal: only the KL
    loss, st = mgrpo.policy_loss(logp, logp.detach(), adv, mask, ref_logp=ref, kl_coef=1.0, agg="token-mean")
    k3 = lambda d: math.exp(d) - d - 1  # noqa: E731  (d = ref - logp)
    assert st["kl_ref"] == pytest.approx((k3(0.0) + k3(1.0)) / 2)
    assert loss.item() == pytest.approx((k3(0.0) + k3(1.0)) / 2)
    loss.backward()
    g = logp.grad[0]
    assert g[0] == 0 and g[1] < 0 and g[2] == 0  # descent raises logp where it is below the reference
    off, _ = mgrpo.policy_loss(logp, logp.detach(), torch.tensor([1.0]), mask, ref_logp=ref, kl_coef=0.0)
    plain, _ = mgrpo.policy_loss(logp, logp.detach(), torch.tensor([1.0]), mask)
    assert off.item() == plain.item()  # kl_coef 0 (the default) is exactly the paper's loss


def test_truncated_is_weight_by_hand():
    """pi_old / pi_sampler per token, capped at IS_CAP (2), 0 off the mask."""
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    sampled = torch.tensor([[-1.0, -1.5, -0.5, -3.0]])
    w = mgrpo.truncated_is_weight(old, sampled, torch.tensor([[1, 1, 1, 0]]))
    assert w.tolist()[0] == pytest.approx([1.0, math.exp(0.5), math.exp(-0.5), 0.0])
    w = mgrpo.truncated_is_weight(old, sampled - 5.0, torch.ones(1, 4))  # drawn against the odds: capped
    assert w.tolist()[0] == pytest.approx([mgrpo.IS_CAP] * 4)


def test_policy_loss_weights_each_tokens_surrogate_by_is_weight_but_not_its_kl():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    mask, adv, ref = torch.tensor([[1, 1, 1]]), torch.tensor([1.0]), torch.tensor([[-1.5, -1.0, -0.5]])
    w = torch.tensor([[2.0, 0.5, 1.0]])
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, agg="token-mean", is_weight=w)
    loss.backward()
    assert loss.item() == pytest.approx(-(2.0 + 0.5 + 1.0) / 3)  # ratio 1: -mean(w * A)
    assert logp.grad[0].tolist() == pytest.approx([-2.0 / 3, -0.5 / 3, -1.0 / 3])  # each token's gradient scaled by w
    with_kl, _ = policy_loss(logp, logp.detach(), adv, mask, agg="token-mean", is_weight=w, ref_logp=ref, kl_coef=1.0)
    k3 = [math.exp(d) - d - 1 for d in (-0.5, 1.0, 0.0)]
    assert with_kl.item() == pytest.approx(loss.item() + sum(k3) / 3)  # the KL term unweighted


def test_a_metrics_line_that_is_not_the_runs_is_named_by_file_and_line_on_resume(tmp_path):
    """A resumed run replays the collapse alarm's streaks from metrics.jsonl: a garbled line is a clear
    error naming the file and the line, not a traceback from json."""
    import mgrpo
    from report import Log
    for bad in ("{not json", "[1, 2]", '{"step": "x"}', "\xff\xfe"):
        (tmp_path / "metrics.jsonl").write_text('{"step": 1, "zero_var_main": 1.0}\n' + bad + "\n",
                                                errors="surrogateescape")
        with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not a metrics line of this run"):
            Log(mgrpo.parse_args([]), {}, str(tmp_path), None, 5, 2)
    log = Log(mgrpo.parse_args([]), {}, str(tmp_path), None, 5, 1)  # the lines a checkpoint covers only
    assert log.streaks == {"flat_main": 1, "flat_sub": 0}
