"""End to end: the command line, its outputs, reproducibility, and a run that learns."""
import dataclasses
import importlib.util
import json
import math
import os
import random
import shutil
import subprocess
import sys
import threading
import time

import huggingface_hub
import pytest
import torch
import transformers

import cold_start
import helpers
import mgrpo
import run
import tools
import toy_server
import toy_tools
from agents import prompt_ids
from tiny_models import word_tokenizer
from checkpoints import checkpoints
from cold_start import encode_demo

SHORT = ["--steps", "3", "--cold-start", '{"steps": 20, "lr": 3e-3}', "--questions-per-step", "4", "--group-size", "4",
         "--eval-questions", "16", "--eval-every", "2"]  # lr 3e-3: M delegates (and S trains) after 20 steps


def timing(key):
    """Is this a clock's figure (t_gen, t_eval, gen_tokens_per_s, ...), which differs from run to run?"""
    return key.startswith("t_") or key.endswith("_per_s")


def metrics(out, evals=False):
    """The step rows of metrics.jsonl (or the evaluation rows), timings left out."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [{k: v for k, v in json.loads(line).items() if not timing(k)} for line in f]
    return [r for r in rows if ("eval" in r) == evals]


def test_short_run_writes_everything(tmp_path):
    out = str(tmp_path / "run")
    summary = mgrpo.main(SHORT + ["--out", out, "--report-to", "tensorboard"])
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("main_reward", "sub_reward", "success", "zero_var_main", "zero_var_sub", "n_dup", "n_drop",
                    "clip_frac_main", "approx_kl_main", "grad_norm_main", "d_k"):
            assert key in r, key
    assert [(r["step"], r["eval"]) for r in metrics(out, evals=True)] == [
        (0, "sampled"), (0, "greedy"), (2, "sampled"), (3, "sampled"), (3, "greedy")]
    with open(os.path.join(out, "summary.json")) as f:
        saved = json.load(f)
    assert saved == json.loads(json.dumps(summary))
    for key in ("eval_success_start", "eval_success_end", "steps", "wall_time_s", "D_paper_rule", "d_k_histogram"):
        assert key in saved, key
    state = torch.load(os.path.join(checkpoints(out)[-1], "state.pt"), weights_only=True)
    assert len(checkpoints(out)) == 1  # two while the run goes on, its last alone once it has ended
    assert state["index"] == len(mgrpo.schedule(mgrpo.parse_args(SHORT))) and state["metrics_lines"] == 8
    assert state["opt"]["main"]["state"] and state["opt"]["sub"]["state"]
    assert set(state["rng"]) == {"python", "torch", "cuda"}  # numpy draws nothing during a run
    # the trained agents load back through the ordinary Hugging Face path
    args = mgrpo.parse_args([])
    for name in ("main", "sub"):
        agent = helpers.load_agent(os.path.join(out, name), args, seed=0)
        assert agent.tok.decode(prompt_ids(agent, name, "city of ada")) == "<user> city of ada <assistant>"
    # --report-to tensorboard: every number of metrics.jsonl in the event file, at its step
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(os.path.join(out, "tb"))
    events.Reload()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    want = {(k if "eval" not in r else f"eval/{r['eval']}_success", r["step"]): v for r in lines
            for k, v in r.items() if type(v) in (int, float) and k != "step" and ("eval" not in r or k == "eval_success")}
    got = {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    assert set(got) == set(want) and len(want) > 8 * 3
    assert all(math.isclose(got[k], want[k], rel_tol=1e-6, abs_tol=1e-6) for k in want)


def test_bad_arguments_fail_clearly(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        mgrpo.parse_args(["--group-size", "1"])
    assert "--group-size must be >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mgrpo.parse_args(["--loss-agg", "sum", "--level", "5"])
    err = capsys.readouterr().err
    assert "--loss-agg" in err and "--level" in err
    for argv, msg in [(["--mode", "solo"], "--mode must be"),
                      (["--mode", "single-agent", "--role", "main", "--store", "s"], "runs in one process"),
                      (["--cold-start", '{"levels": [1, 4]}'], "level must be 1, 2 or 3, got 4"),
                      (["--level", "2,"], "--level: invalid int value: '2,'"),
                      (["--level", "1", "4"], "level must be 1, 2 or 3, got 4"),
                      (["--level", "0"], "--level must be levels"),
                      (["--lr", "1e-3", "1e-3", "1e-3"], "--lr takes one rate > 0, or two"),
                      (["--max-turns", "4", "1"], "--max-turns must be >= 2"),
                      (["--clip-eps", "-0.1", "0.2"], "--clip-eps must be >= 0"),
                      (["--report-to", "mlflow"], "--report-to must be tensorboard or wandb"),
                      (["--cold-start", '{"until": 0.9}', "--role", "sub", "--store", "s"], "it needs --role both"),
                      (["--cold-start", '{"until": 0.9, "steps": 0}'], "needs cold-start steps")]:
        with pytest.raises(SystemExit):
            mgrpo.parse_args(argv)
        assert msg in capsys.readouterr().err
    real = importlib.util.find_spec  # an optional logger not installed: said before anything runs
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(SystemExit):
        mgrpo.parse_args(["--report-to", "tensorboard"])
    assert "needs its package: pip install tensorboard" in capsys.readouterr().err


def test_a_context_budget_that_holds_no_turn_stops_at_start_up(tmp_path, capsys):
    """--max-context below an agent's prompt and one turn would end every conversation before its first turn:
    the run stops at start-up, naming the agent and what it needs, before any cold start."""
    with pytest.raises(SystemExit, match=r"--max-context 12 holds not even main's prompt and one turn \(\d+ tokens"):
        mgrpo.main(["--max-context", "12", "--cold-start", "5", "--steps", "1", "--out", str(tmp_path)])
    assert "cold start" not in capsys.readouterr().out


def test_a_bad_cold_start_is_a_clear_error_naming_its_file_and_line(tmp_path, capsys):
    """--cold-start is a preset, a number of steps, or JSON, inline or in a file: whatever the text or
    the file holds, a bad one stops the run before anything starts, with a message that names the file
    (and the line of a JSON error), never a traceback."""
    (tmp_path / "bad.json").write_text('{\n  "steps": 10,\n  "batch": ,\n}\n')
    (tmp_path / "nested.json").write_text("[" * 100_000)
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00\x81 garbage")
    (tmp_path / "big.json").write_text('{"steps": 1, "pad": "' + "x" * (2 << 20) + '"}')  # read up to 1 MiB
    (tmp_path / "good.json").write_text('{"preset": "chat", "steps": 7}')
    (tmp_path / "list.json").write_text('[1, 2]')
    for spec, msg in [(tmp_path / "bad.json", "bad.json: not JSON (line 3, column 12"),
                      (tmp_path / "missing.json", "missing.json: [Errno 2] No such file"),
                      (tmp_path, "Is a directory"), (tmp_path / "nested.json", "nested.json: maximum recursion"),
                      (tmp_path / "binary.json", "binary.json: 'utf-8' codec can't decode"),
                      (tmp_path / "big.json", "big.json: not JSON (line 1"),
                      ("fast", "fast: [Errno 2] No such file"), ("-5", "steps must be >= -1"),
                      ('{"steps": "10"}', "steps must be int, not '10'"), ('{"steps": 1.5}', "steps must be int"),
                      ('{"levels": "1,2"}', "levels must be a list of levels"), ('{"levels": [0]}', "levels >= 1"),
                      ('{"uniform_first_layer": 1}', "uniform_first_layer must be bool"),
                      ('{"lr": Infinity}', "lr must be float"), ('{"until": NaN}', "until must be float"),
                      ('{"preset": "fast"}', "no preset 'fast'"), ('{"preset": []}', "unhashable"),
                      ('{"stepz": 3}', "unknown fields ['stepz']"), (tmp_path / "list.json", "list.json: not a JSON object")]:
        with pytest.raises(SystemExit):
            mgrpo.parse_args(["--cold-start", str(spec)])
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, (spec, err[-300:])
        assert "argument --cold-start" in err and "give a preset (demo, none, chat, smollm2)" in err or "not JSON" in err
    assert mgrpo.parse_args(["--cold-start", str(tmp_path / "good.json")]).cold_start == cold_start.ColdStart(
        steps=7, batch=16, bare=0.75, until=0.6)  # over the chat preset
    assert mgrpo.parse_args(["--cold-start", "none"]).cold_start.steps == 0
    assert mgrpo.parse_args([]).cold_start == cold_start.ColdStart() == mgrpo.parse_args(["--cold-start", "demo"]).cold_start


def test_the_cold_start_goes_on_until_its_check_passes_or_three_more_rounds(tmp_path, capsys, monkeypatch):
    """A check (until): greedy success per demo level, on held-out questions that evaluations never use,
    after the cold start; below the bar, another round on new demos from fresh weights, at most 3 times."""
    calls, score = [], [0.0]

    def fake_evaluate(main, args, task, delegate, search, greedy=False, first=mgrpo.EVAL_SEED):
        calls.append((*args.level, args.eval_questions, greedy, first))
        return score[0]
    monkeypatch.setattr(mgrpo, "evaluate", fake_evaluate)
    base, cold = ["--steps", "0", "--model-size", "0.1M", "--eval-questions", "8"], {"steps": 5, "levels": [1, 2]}
    check = ["--cold-start", json.dumps({**cold, "until": 0.9})]
    summary = mgrpo.main(base + check + ["--out", str(tmp_path / "never")])
    out = capsys.readouterr().out
    assert out.count("from fresh weights), final loss") == 3 and out.count("cold-start check") == 4
    assert all(f"(round {r}, from fresh weights)" in out for r in (2, 3, 4))
    assert out.count("below 0.9: going on") == 3 and out.count("below 0.9") == 4
    assert "did not reach 0.9" in out
    assert summary["sft_check"] == {"passed": False, "rounds": 4, "greedy": {"1": 0.0, "2": 0.0}}
    checks = [c for c in calls if c[3] != mgrpo.EVAL_SEED]
    assert checks == [(1, 256, True, mgrpo.EVAL_SEED + 2 ** 30), (2, 256, True, mgrpo.EVAL_SEED + 2 ** 30)] * 4
    assert mgrpo.EVAL_SEED + 2 ** 30 >= mgrpo.EVAL_SEED + 256  # the check's questions are not eval's
    calls.clear()
    score[0] = 0.9
    assert mgrpo.main(base + check + ["--out", str(tmp_path / "passes")])["sft_check"]["rounds"] == 1
    base += ["--cold-start", json.dumps(cold)]
    assert "sft_check" not in mgrpo.main(base + ["--out", str(tmp_path / "off")])
    out = capsys.readouterr().out
    assert "fresh weights" not in out
    assert out.count("cold-start check") == 1 and out.count("cold start on noisy demos") == 2
    assert len([c for c in calls if c[3] != mgrpo.EVAL_SEED]) == 2
    # garbage in a run folder's sft_check.json is a warning, not a crash; an earlier run's is not reported
    (tmp_path / "off" / "sft_check.json").write_text("{ not json")
    assert "sft_check" not in mgrpo.main(base + ["--out", str(tmp_path / "off"), "--resume"])
    assert "sft_check.json cannot be read" in capsys.readouterr().out
    (tmp_path / "off" / "sft_check.json").write_text((tmp_path / "passes" / "sft_check.json").read_text())
    assert "sft_check" not in mgrpo.main(base + ["--out", str(tmp_path / "off"), "--overwrite"])  # not its check


def test_a_round_after_a_failed_check_starts_from_fresh_weights(tmp_path, monkeypatch):
    """Each round after a failed check starts an agent built here from new random weights, drawn from
    a seed of the round's own, not from the stalled weights of the round before; a given model (a
    path) goes on from where its last round left it."""
    monkeypatch.setattr(mgrpo, "evaluate", lambda *a, **k: 0.0)  # never passes: four rounds
    starts, ends, real = [], [], cold_start.cold_start

    def recorded(agent, kind, args, task, seed, steps):
        starts.append((kind, {k: v.clone() for k, v in agent.model.state_dict().items()}))
        loss = real(agent, kind, args, task, seed, steps)
        ends.append((kind, {k: v.clone() for k, v in agent.model.state_dict().items()}))
        return loss
    monkeypatch.setattr(cold_start, "cold_start", recorded)
    base = ["--steps", "0", "--cold-start", '{"steps": 3, "batch": 2, "until": 0.9}', "--model-size", "0.1M",
            "--eval-every", "0"]
    mgrpo.main(base + ["--out", str(tmp_path / "built")])
    same = lambda a, b: all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731
    assert [k for k, _ in starts] == ["main", "sub"] * 4
    tok = word_tokenizer(toy_tools.WORDS)
    for i, (kind, w) in enumerate(starts[2:], 2):
        fresh = cold_start.build_model(tok, "0.1M", False, tools.stable_seed(1, "init", kind, i // 2))
        w_new = fresh.state_dict()
        assert same(w, w_new) and not same(w, ends[i - 2][1])  # new weights, not the last round's
    assert not same(starts[2][1], starts[0][1])  # a new draw, not the first round's init again
    # a given model: each round goes on from the weights the round before left
    mgrpo.main(["--steps", "0", "--cold-start", "1", "--model-size", "0.1M", "--out", str(tmp_path / "given")])
    starts.clear()
    ends.clear()
    given = str(tmp_path / "given" / "main")
    mgrpo.main(base + ["--main-model", given, "--sub-model", given, "--out", str(tmp_path / "from-given")])
    assert len(starts) == 8 and all(same(starts[i][1], ends[i - 2][1]) for i in range(2, 8))


@pytest.mark.slow
def test_agents_cold_started_at_once_in_processes_end_as_in_one_process(monkeypatch):
    """On a CPU with cores to spare, the agents' cold starts run at once, each in a process of its own:
    each agent ends with the weights and final loss that the same cold starts, one after another in
    this process, give."""
    args = mgrpo.parse_args(["--model-size", "0.1M", "--cold-start", '{"batch": 2}'])
    torch.set_num_threads(1)  # as each process of the pool runs: the same sums, to float rounding
    kept = []
    for cores in (4, 1):
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
        agents = {"main": helpers.load_agent("", args, 0), "sub": helpers.load_agent("", args, 1)}
        losses = cold_start.cold_start_round(agents, {"main": 100, "sub": 100}, args, toy_tools)
        kept.append((losses, {n: a.model.state_dict() for n, a in agents.items()}))
    (at_once, w_once), (in_turn, w_turn) = kept
    assert at_once == pytest.approx(in_turn, rel=1e-4) and set(at_once) == {"main", "sub"}
    for n in ("main", "sub"):
        assert all(torch.allclose(w_once[n][k], w_turn[n][k], atol=1e-4) for k in w_turn[n])
    assert not torch.equal(w_once["main"]["lm_head.weight"], w_once["sub"]["lm_head.weight"])


@pytest.mark.slow
def test_a_cold_start_cut_off_between_rounds_resumes_after_its_last_round(tmp_path, capsys, monkeypatch):
    """Each round of the cold start ends in a checkpoint: a run killed in round 3 resumes after round 2
    and ends with the weights and check of a run never killed (and with its RNG state: two RL steps)."""
    monkeypatch.setattr(mgrpo, "evaluate", lambda *a, **k: 0.0)  # the check never passes: four rounds
    cold = {"steps": 5, "batch": 4, "levels": [1, 2]}
    base = ["--steps", "2", "--model-size", "0.1M", "--eval-every", "0", "--questions-per-step", "2", "--group-size",
            "2", "--cold-start", json.dumps({**cold, "until": 0.9})]
    whole = mgrpo.main(base + ["--out", str(tmp_path / "whole")])
    real, rounds, kill = cold_start.cold_start_round, [], [True]

    def killed_once_in_round_3(agents, steps, args, task, rnd=0):
        rounds.append(rnd)
        if rnd == 2 and kill and kill.pop():
            raise KeyboardInterrupt
        return real(agents, steps, args, task, rnd)
    monkeypatch.setattr(cold_start, "cold_start_round", killed_once_in_round_3)
    with pytest.raises(KeyboardInterrupt):
        mgrpo.main(base + ["--out", str(tmp_path / "cut")])
    assert rounds == [0, 1, 2]
    shutil.copytree(tmp_path / "cut", tmp_path / "cut-then-no-check")
    capsys.readouterr()
    resumed = mgrpo.main(base + ["--out", str(tmp_path / "cut"), "--resume"])
    assert rounds == [0, 1, 2, 2, 3] and "in the cold start after round 2" in capsys.readouterr().out
    assert resumed["sft_check"] == whole["sft_check"] == {"passed": False, "rounds": 4, "greedy": {"1": 0.0, "2": 0.0}}
    assert metrics(tmp_path / "cut") == metrics(tmp_path / "whole")
    for n in ("main", "sub"):
        a, b = (transformers.AutoModelForCausalLM.from_pretrained(tmp_path / run / n).state_dict() for run in ("whole", "cut"))
        assert all(torch.equal(a[k], b[k]) for k in a)
    # resumed without a check: the two rounds behind it are its cold start
    rounds.clear()
    unchecked = base[:-1] + [json.dumps(cold)]
    assert "sft_check" not in mgrpo.main(unchecked + ["--out", str(tmp_path / "cut-then-no-check"), "--resume"])
    assert rounds == []


@pytest.mark.slow
def test_a_fresh_run_in_a_used_folder_keeps_its_own_checkpoints(tmp_path):
    """With --overwrite, an earlier run's checkpoints in the folder go: the fresh run's are never pruned
    as older than them (a later --resume would continue the earlier run)."""
    base = ["--cold-start", '{"steps": 2, "batch": 4}', "--model-size", "0.1M", "--eval-every", "0",
            "--questions-per-step", "2", "--group-size", "2"]
    mgrpo.main(base + ["--steps", "4", "--out", str(tmp_path / "used")])
    for folder in ("used", "empty"):
        mgrpo.main(base + ["--steps", "1", "--overwrite", "--out", str(tmp_path / folder)])
    names = [[os.path.basename(p) for p in checkpoints(str(tmp_path / f))] for f in ("used", "empty")]
    assert names[0] == names[1] and len(names[0]) == 1  # an ended run keeps its last


def test_single_agent_keeps_every_search_result_in_its_own_context(cold_start_dir):
    """The single-agent baseline searches for itself: each search's eight level-2 snippets
    enter its own context with mask 0 (the cold-started sub-agent stands in: it searches)."""
    args = mgrpo.parse_args(["--mode", "single-agent", "--level", "2", "--cold-start", "0"])
    agent = helpers.load_agent(cold_start_dir["sub"], args, seed=0)
    qs = [toy_tools.make_question(s, 2) for s in range(4)]
    trajs, subs = mgrpo.rollout(agent, qs, 2, args, 0, search=toy_tools.ToySearch())
    assert subs == [] and [(t.q, t.k) for t in trajs] == [(q, k) for q in range(4) for k in range(2)]
    searched = 0
    for t in trajs:
        assert len(t.ids) == len(t.mask) == len(t.logp)
        assert all(lp == 0.0 for lp, m in zip(t.logp, t.mask) if not m)
        inserted = agent.tok.decode([i for i, m in zip(t.ids, t.mask) if not m]).split()
        n_tool = inserted.count("<tool>")
        assert inserted.count(";") == 7 * n_tool  # every result whole, none of it trained on
        searched += n_tool
    assert searched >= len(trajs) // 2


def test_failed_search_is_an_observation_not_a_crash(cold_start_dir):
    """A backend that fails during a rollout: S reads the error as the search's result."""
    class Down:
        def search(self, query, seed, level):
            raise tools.SearchError("search server http://x answered 503: busy (after 3 tries)")
    args = mgrpo.parse_args(["--cold-start", "0"])
    sub = helpers.load_agent(cold_start_dir["sub"], args, seed=0)
    qs = [toy_tools.make_question(s, 1) for s in range(4)]
    trajs = mgrpo.run_sub_agents(sub, args, Down(), [f"city of {q.text.split()[-2]}" for q in qs], qs, seed=0)
    tool_msgs = [sub.tok.decode([i for i, m in zip(t.ids, t.mask) if not m]) for t in trajs]
    # the cold-started S searches, and each search is answered by the error text (words
    # outside the toy vocabulary, so <unk> tokens), with loss mask 0
    assert sum("<tool>" in m and "<unk>" in m for m in tool_msgs) >= 3
    assert all(len(t.ids) == len(t.mask) == len(t.logp) for t in trajs)


def test_main_context_stays_short_single_agent_context_grows():
    """What delegation buys at level 2: M reads one word per sub-task; a single agent
    reads every result list (scripted demos, so the count is exact)."""
    agent = helpers.load_agent("", mgrpo.parse_args([]), seed=0)
    q = toy_tools.make_question(9, 2)
    rng = random.Random(0)
    main_len = len(encode_demo(agent, toy_tools.main_demo(q, rng, 0.0), "main").ids)
    single_len = len(encode_demo(agent, toy_tools.single_demo(q, rng, 0.0), "single").ids)
    assert single_len > 3 * main_len, (main_len, single_len)


@pytest.mark.slow
def test_same_seed_same_run_and_http_search_agrees(tmp_path):
    srv = toy_server.make_server(0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        a = mgrpo.main(SHORT + ["--out", str(tmp_path / "a")])
        b = mgrpo.main(SHORT + ["--out", str(tmp_path / "b"), "--search", url])
    finally:
        srv.shutdown()
    assert metrics(tmp_path / "a") == metrics(tmp_path / "b")
    assert metrics(tmp_path / "a", evals=True) == metrics(tmp_path / "b", evals=True)
    assert a["eval_success_end"] == b["eval_success_end"]
    c = mgrpo.main(SHORT + ["--out", str(tmp_path / "c"), "--seed", "2"])
    assert metrics(tmp_path / "c") != metrics(tmp_path / "a")
    assert c["steps"] == 3


def test_down_search_server_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="not reachable"):
        mgrpo.main(SHORT + ["--out", str(tmp_path / "x"), "--search", "http://127.0.0.1:9"])
    assert not (tmp_path / "x").exists()  # a failed start leaves no run folder


def test_a_users_mistakes_at_start_up_get_one_line_and_leave_no_folder(tmp_path, monkeypatch, capsys):
    """Each mistake a user is likely to make stops the run before its folder is made, with one line that says
    what to fix (argparse's error, or SystemExit's message: no traceback), within seconds."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on a machine that cannot reach the hub
    corpus, bad = tmp_path / "corpus.jsonl", tmp_path / "bad.jsonl"
    corpus.write_text(json.dumps({"id": "1", "contents": "Ulm\nUlm is in Germany."}) + "\n")
    bad.write_text(corpus.read_text() + "{not json\n")
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question": f"q{i}?", "answers": ["Ulm"], "split": s}) + "\n"
                                 for i, s in enumerate(["train", "test"] * 2)))
    cases = [(["--search", f"bm25:{tmp_path / 'missing.jsonl'}"], "missing.jsonl"),
             (["--search", str(corpus)], f"--search bm25:{corpus}"),
             (["--search", "http://127.0.0.1:9"], "not reachable"),
             (["--chat", "--task", f"qa:{questions}"], "no search tool of its own: give --search bm25:"),
             (["--judge", "http://127.0.0.1:9"], "not reachable"),
             (["--main-model", "does-not-exist"], "cannot be reached to download it; --main-model smollm2 needs no"),
             (["--sub-model", "./models/does-not-exist"], "no such folder here"),
             (["--main-model", str(tmp_path)], "the folder holds no model (no config.json or adapter_config.json)")]
    if importlib.util.find_spec("bm25s"):
        cases.append((["--search", f"bm25:{bad}"], "bad.jsonl, line 2: not JSON"))
    broken = tmp_path / "broken"  # found once the folder is made: it goes again
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    late = [(["--main-model", str(broken)], f"--main-model {broken} cannot be loaded"),
            (["--sub-model", "does-not-exist/either"], "--sub-model does-not-exist/either cannot be loaded")]
    for argv, says in cases + late:
        if argv == late[1][0]:
            monkeypatch.setattr(run, "hub_reachable", lambda timeout=3.0: True)  # the hub is there, no such model:
            monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # a fast refusal, as its 404
        t0 = time.time()
        with pytest.raises(SystemExit) as e:
            mgrpo.main(SHORT + ["--out", str(tmp_path / "run")] + argv)
        message = str(e.value.code) if e.value.code not in (1, 2) else capsys.readouterr().err.strip().splitlines()[-1]
        assert says in message and "\n" not in message and time.time() - t0 < 20, (argv, message)
        assert e.value.code != 0 and not (tmp_path / "run").exists(), argv
        capsys.readouterr()
    adapters = tmp_path / "adapters"  # LoRA adapters over their base (agents.load_agent) are a model's folder too
    adapters.mkdir()
    (adapters / "adapter_config.json").write_text("{}")
    assert mgrpo.parse_args(["--main-model", str(adapters)]).main_model == str(adapters)


def test_success_rises(cold_start_dir, tmp_path):
    """M-GRPO from the saved cold start, loaded by path: sampled success goes up."""
    s = mgrpo.main(["--main-model", cold_start_dir["main"], "--sub-model", cold_start_dir["sub"], "--cold-start", "0",
                    "--steps", "60", "--eval-questions", "128", "--eval-every", "0", "--out", str(tmp_path)])
    assert s["eval_success_end"] >= s["eval_success_start"] + 0.1, s
    rows = metrics(tmp_path)
    first, last = rows[:10], rows[-10:]
    assert sum(r["main_reward"] for r in last) > sum(r["main_reward"] for r in first)


def test_gpu_options_run_on_cpu_and_resume(cold_start_dir, tmp_path, capsys, monkeypatch):
    """--dtype bfloat16 (autocast), gradient checkpointing, micro-batches and the KL to a
    frozen reference together; a crash in step 3, then a resume that must find the same reference."""
    opts = ["--main-model", cold_start_dir["main"], "--sub-model", cold_start_dir["sub"], "--cold-start", "0",
            "--questions-per-step", "4", "--group-size", "4", "--eval-questions", "8", "--eval-every", "0",
            "--dtype", "bfloat16", "--grad-checkpointing", "--micro-batch", "8", "--kl-coef", "0.05",
            "--steps", "3", "--lr", "3e-3", "--out", str(tmp_path)]
    real_step = mgrpo.train_step
    monkeypatch.setattr(mgrpo, "train_step", helpers.crashing(real_step, 3))
    with pytest.raises(KeyboardInterrupt):
        mgrpo.main(opts)
    assert "memory estimate, main:" in capsys.readouterr().out
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ref" / "sub"))
    start = helpers.load_agent(cold_start_dir["sub"], mgrpo.parse_args([]), seed=0).model
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), start.parameters()))  # S as RL started
    monkeypatch.setattr(mgrpo, "train_step", real_step)
    s = mgrpo.main(opts + ["--resume"])
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3] and s["steps"] == 3
    assert rows[0]["kl_ref_main"] < 1e-4 < rows[2]["kl_ref_main"]  # the policy moves away from the reference
    assert all(math.isfinite(r["grad_norm_main"]) for r in rows)


def test_gradient_checkpointing_changes_no_gradient(cold_start_dir):
    q = [toy_tools.make_question(s, 1) for s in range(4)]
    grads = []
    for ckpt in ([], ["--grad-checkpointing"]):
        args = mgrpo.parse_args(["--micro-batch", "2"] + ckpt)
        agent = helpers.load_agent(cold_start_dir["main"], args, seed=0)
        trajs = [encode_demo(agent, toy_tools.main_demo(x, random.Random(0), 0.3), "main") for x in q]
        agent.opt = torch.optim.SGD(agent.model.parameters(), lr=0.0)
        mgrpo.update_agent(agent, trajs, torch.tensor([1.0, -1.0, 0.5, -0.5]), args)
        grads.append(torch.cat([p.grad.flatten() for p in agent.model.parameters() if p.requires_grad]))
    assert grads[0].abs().sum() > 0 and torch.allclose(grads[0], grads[1], atol=1e-6)


def test_help_lists_every_option_with_its_docstring(capsys):
    with pytest.raises(SystemExit) as e:
        mgrpo.parse_args(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "option_strings" not in out
    flat = "".join(out.split())  # argparse wraps lines, hyphenated words too
    for f in dataclasses.fields(mgrpo.Args):
        assert "--" + f.name.replace("_", "-") in out and "".join(f.metadata["help"].split()) in flat, f.name


def _stat(pid):
    """(state, parent pid) of a process from /proc, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        return state, int(ppid)
    except (OSError, ValueError):
        return None


def _alive(pid):
    return (_stat(pid) or ("Z",))[0] != "Z"


def _children(pid):
    """{pid: command line} of the live processes whose parent is `pid` (Linux /proc)."""
    kids = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if _alive(d) and _stat(d)[1] == pid:
            kids[int(d)] = cmd
    return kids


@pytest.mark.slow
def test_a_killed_run_takes_its_cold_start_workers_with_it(tmp_path):
    """The two agents' cold starts run in worker processes; killed midway, a run leaves none of
    them training on (they watch their parent)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "mgrpo.py", "--cold-start", "100000", "--steps", "0", "--model-size", "0.1M", "--out", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            workers = [p for p, cmd in _children(proc.pid).items() if "spawn_main" in cmd]
            if len(workers) == 2:
                break
            time.sleep(0.2)
        assert len(workers) == 2, "the cold starts did not start in two worker processes"
        time.sleep(2)
        assert all(_alive(p) for p in workers)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.time() + 30
    while any(_alive(p) for p in workers) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in workers)


def test_a_run_in_which_every_rollout_scores_the_same_raises_the_collapse_alarm(tmp_path, capsys):
    """Models with no cold start never keep the format: every reward is 0, every group has zero variance and
    M never delegates. From step ALARM_STEPS on, metrics.jsonl and the progress line say so, and the
    message that says what it means and what to try is printed once per signature."""
    from report import ALARM_STEPS
    out = str(tmp_path / "run")
    n = ALARM_STEPS + 2
    mgrpo.main(["--steps", str(n), "--cold-start", "none", "--questions-per-step", "2", "--group-size", "2",
                "--eval-questions", "4", "--eval-every", "5", "--max-new-tokens", "8", "--out", out])
    rows = metrics(out)
    assert all(r["main_reward"] == 0 and r["zero_var_main"] == 1.0 and not any(r["d_k"]) for r in rows)
    assert [r.get("alarm") for r in rows] == [None] * (ALARM_STEPS - 1) + [["flat_main", "no_delegation"]] * 3
    printed = capsys.readouterr().out
    assert printed.count("ALARM flat_main for") == 1 and printed.count("ALARM no_delegation for") == 1
    assert "M's advantages are all 0 (eq. 10)" in printed and "a lower --lr" in printed
    assert printed.count("| ALARM flat_main, no_delegation") == 3
    # each evaluation: the share of zero-variance groups over the steps since the one before
    evals = metrics(out, evals=True)
    assert [(r["step"], r.get("zero_var_main")) for r in evals] == [
        (0, None), (0, None), (5, 1.0), (10, 1.0), (n, 1.0), (n, 1.0)]
    assert "zero-variance groups since the last evaluation: M 1.00" in printed
