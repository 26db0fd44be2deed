"""What each policy update does to an agent's weights: a stage-2 run (mgrpo.py's options, given as
they are) with every update of each agent measured, one JSON line per update in <out>/updates.jsonl:

  agent, step          which agent, after which M-GRPO step
  rows, rows_signal    the batch's trajectories, and those with a non-zero advantage (the only ones
                       whose clipped surrogate has a gradient; the KL penalty's reaches every row)
  tokens_signal        the trained tokens (loss mask 1) of those rows
  adv_max              the largest |advantage| in the batch
  grad_norm            the gradient's norm before the clip (--grad-clip)
  grad_rms_over_v      the clipped gradient's RMS over the RMS of sqrt(v_hat), AdamW's second moment
                       before this step: how large this gradient is against the recent ones (AdamW's
                       step does not scale with the gradient's norm, only with this ratio)
  step_rms_over_lr     the parameter change's RMS over the learning rate
  step_max_over_lr     the largest per-tensor max |change| over the learning rate, and its tensor
  step_norm            the parameter change's norm
  kl_batch, dlogp_max  what the update did to the policy on its own batch: the mean over the trained
                       tokens of log p_old - log p_new (the sampling log-probs against the updated
                       model's), and the largest |log p_new - log p_old| of a trained token

experiments/stage2-probes.md uses it on the stage 1 whose co-train runs fell:

    python -m experiments.update_probe <the stage-2 run's mgrpo.py options> --out <folder>
"""
import json
import os

import mgrpo
from sampling import batch_logprobs, collate


def adam_v_rms(opt, params):
    """The RMS of sqrt(v_hat) over the parameters that have AdamW state (None before the first step)."""
    beta2, sq, n = opt.defaults["betas"][1], 0.0, 0
    for p in params:
        state = opt.state.get(p, {})
        if "exp_avg_sq" in state:
            t = float(state["step"])
            sq += float((state["exp_avg_sq"] / (1 - beta2 ** t)).sum())
            n += p.numel()
    return (sq / n) ** 0.5 if n else None


def policy_moved(agent, trajs):
    """How far the updated model's log-probs of the batch's trained tokens are from the sampling ones."""
    batch = collate(trajs, agent.pad_id, agent.model.device)
    _, _, mask, old = batch
    diff = (old - batch_logprobs(agent, agent.model, batch).float()) * mask
    return {"kl_batch": float(diff.sum() / mask.sum().clamp(min=1)), "dlogp_max": float(diff.abs().max())}


def probe(update_agent, names, current, path):
    """update_agent, wrapped: each call measured and written to `path`."""
    def probed(agent, trajs, adv, args, **kw):
        params = [p for p in agent.model.parameters() if p.requires_grad]
        before, lr = [p.detach().clone() for p in params], agent.opt.param_groups[0]["lr"]
        v_rms = adam_v_rms(agent.opt, params)
        out = update_agent(agent, trajs, adv, args, **kw)
        g = [p.grad for p in params if p.grad is not None]  # the last epoch's, as clipped
        g_rms = (sum(float((x.float() ** 2).sum()) for x in g) / sum(p.numel() for p in params)) ** 0.5
        deltas = [(p.detach() - b) for p, b in zip(params, before)]
        worst = max(range(len(params)), key=lambda i: float(deltas[i].abs().max()))
        signal = [t for t, a in zip(trajs, adv.tolist()) if a != 0]
        rec = {"agent": names[id(agent)], "step": current["step"], "rows": len(trajs), "rows_signal": len(signal),
               "tokens_signal": sum(sum(t.mask) for t in signal), "adv_max": float(adv.abs().max()),
               "grad_norm": out.get("grad_norm"), "grad_rms_over_v": g_rms / v_rms if v_rms else None,
               "step_rms_over_lr": (sum(float((d ** 2).sum()) for d in deltas) / sum(d.numel() for d in deltas))
               ** 0.5 / lr, "step_max_over_lr": float(deltas[worst].abs().max()) / lr,
               "step_max_tensor": [n for n, p in agent.model.named_parameters() if p is params[worst]][0],
               "step_norm": sum(float((d ** 2).sum()) for d in deltas) ** 0.5}
        rec.update(policy_moved(agent, trajs))
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return out
    return probed


def main(argv=None):
    args = mgrpo.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path, names, current = os.path.join(args.out, "updates.jsonl"), {}, {"step": 0}
    if os.path.exists(path):
        os.remove(path)
    train_step, update_agent = mgrpo.train_step, mgrpo.update_agent

    def stepping(main_agent, sub, step, *rest, **kw):
        names.update({id(main_agent): "main", id(sub): "sub"})
        current["step"] = step
        return train_step(main_agent, sub, step, *rest, **kw)
    mgrpo.train_step, mgrpo.update_agent = stepping, probe(update_agent, names, current, path)
    try:
        mgrpo.main(argv)
    finally:
        mgrpo.train_step, mgrpo.update_agent = train_step, update_agent
    print(f"updates measured: {path}")
    return path


if __name__ == "__main__":
    main()
