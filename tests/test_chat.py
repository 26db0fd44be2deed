"""The chat path real instruct models take: a tiny Qwen2 with a Qwen-style chat template,
saved to a folder and loaded back by name, tool calls as <tool_call> JSON, contexts grown
as token ids; trained in one process and in two."""
import copy
import json
import os
import random
import subprocess
import sys

import pytest

import helpers
import mgrpo
import tools
import toy_server
import toy_tools
from agents import message_ids, prompt_ids
from cold_start import encode_demo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--cold-start", "0", "--questions-per-step", "2", "--group-size", "4", "--max-new-tokens", "40",
       "--eval-questions", "4", "--eval-every", "0"]

pytestmark = pytest.mark.slow  # every test here trains models or runs processes


@pytest.fixture(scope="module")
def chat_dir(chat_run):
    return {name: os.path.join(chat_run[1], name) for name in ("main", "sub")}


def test_the_chat_path_learns(chat_run):
    """The cold start reads the search results (its check passes in one round, on questions of its own; the
    greedy system right on nearly every level-1 test question), and RL raises sampled success."""
    s, _ = chat_run
    assert s["sft_check"]["passed"] and s["sft_check"]["rounds"] == 1 and s["sft_check"]["greedy"]["1"] >= 0.8, s
    assert s["eval_greedy_success_start"] >= 0.9, s
    assert s["eval_success_end"] >= s["eval_success_start"] + 0.1, s


def test_chat_agent_loads_by_path_with_its_template(chat_dir):
    agent = helpers.load_agent(chat_dir["sub"], mgrpo.parse_args([]), seed=0)
    assert agent.chat and agent.tok.decode([agent.end[0]]) == "<|im_end|>" and agent.pad_id != agent.end[0]
    text = agent.tok.decode(prompt_ids(agent, "sub", "city of ada"))
    assert text.startswith("<|im_start|>system\n" + toy_tools.SYSTEM["sub"])
    assert '"name": "search"' in text and '"name": "visit"' in text and '"name": "sub_agent"' not in text
    assert text.endswith("<|im_start|>user\ncity of ada<|im_end|>\n<|im_start|>assistant\n")
    # built in code and reloaded: the same ids for the same text
    fresh = helpers.load_agent("", mgrpo.parse_args(["--chat"]), seed=0)
    assert prompt_ids(fresh, "sub", "city of ada") == prompt_ids(agent, "sub", "city of ada")


@pytest.mark.parametrize("who,demo", [("main", toy_tools.main_demo), ("sub", toy_tools.sub_demo),
                                      ("single", toy_tools.single_demo)])
def test_incremental_ids_equal_the_whole_conversation(chat_dir, who, demo):
    agent = helpers.load_agent(chat_dir["main"], mgrpo.parse_args([]), seed=0)
    schemas = [tools.TOOLS[n] for n in tools.CHAT_TOOLS[who]]
    for s in range(8):
        msgs = demo(toy_tools.make_question(s, 1 + s % 2), random.Random(s), 0.1, chat=True)
        t = encode_demo(agent, msgs, who)
        whole = agent.tok.apply_chat_template([{"role": "system", "content": toy_tools.SYSTEM[who]}] + msgs,
                                              tools=schemas, tokenize=False)
        assert agent.tok.decode(t.ids) + "\n" == whole  # the template adds a newline after the last turn
        trained = [agent.tok.decode([i for i, m in zip(t.ids, t.mask) if m])]
        assert trained == ["".join(m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant")]


def test_message_ids_survive_template_quirks(chat_dir):
    """Qwen3-style templates render the last assistant turn with an empty think block, and
    Qwen2.5-style ones add a default system prompt to a conversation without one: a tool
    message rendered alone, or by diffing two renders, would carry either into the context."""
    agent = helpers.load_agent(chat_dir["main"], mgrpo.parse_args([]), seed=0)
    want = "\n<|im_start|>user\n<tool_response>\nbo\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert agent.tok.decode(message_ids(agent, "tool", "bo")) == want
    quirky = copy.deepcopy(agent)
    quirky.tok.chat_template = agent.tok.chat_template.replace(
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content']",
        "{{ '<|im_start|>' + m['role'] + '\\n' + ('<think>\\n\\n</think>\\n\\n' if loop.last and "
        "m['role'] == 'assistant' else '') + m['content']")
    assert quirky.tok.chat_template != agent.tok.chat_template
    assert "<think>" in quirky.tok.apply_chat_template([{"role": "user", "content": "a"},
                                                        {"role": "assistant", "content": "b"}], tokenize=False)
    assert quirky.tok.decode(message_ids(quirky, "tool", "bo")) == want


def test_chat_actions_parse_or_get_format_zero():
    call = '<tool_call>\n{"name": "search", "arguments": {"query": "ada"}}\n</tool_call>'
    assert tools.parse_chat_action(call, "sub") == ("search", "ada")
    assert tools.parse_chat_action("Let me look.\n" + call, "sub") == ("search", "ada")
    assert tools.parse_chat_action("<think>hm</think><answer> Norland </answer>", "main") == ("answer", "Norland")
    assert tools.parse_chat_action("<answer> avon </answer>", "sub") == ("return", "avon")
    visit = '<tool_call>{"name": "visit", "arguments": {"url": "toy://page/1/1/ada"}}</tool_call>'
    assert tools.parse_chat_action(visit, "single") == ("visit", "toy://page/1/1/ada")
    task = '<tool_call>{"name": "sub_agent", "arguments": {"task": "city of ada"}}</tool_call>'
    assert tools.parse_chat_action(task, "main") == ("call", "city of ada")
    for bad, who in [(call, "main"),                      # a tool this agent does not have
                     (task, "sub"),
                     ('<tool_call>{"name": "search"}</tool_call>', "sub"),   # no arguments
                     ('<tool_call>{"name": "search", "arguments": {"query": ""}}</tool_call>', "sub"),
                     ('<tool_call>{"name": "search", "arguments": {"q": "ada"}}</tool_call>', "sub"),
                     ('<tool_call>{"name": "search", "arguments": {"query": 3}}</tool_call>', "sub"),
                     ("<tool_call>search ada</tool_call>", "sub"),           # not JSON
                     ('<tool_call>["search"]</tool_call>', "sub"),
                     ("<tool_call>" + call, "sub"),                           # nested
                     (call + call, "sub"), (call + "<answer> x </answer>", "sub"),
                     (call + " and more", "sub"), ("<answer> </answer>", "main"),
                     ("norland", "main"), ("", "main"), ("<answer> x", "main")]:
        assert tools.parse_chat_action(bad, who) is None, bad
    for tag, arg, who in [("call", "city of ada", "main"), ("search", "bo", "sub"), ("visit", "toy://page/1/1/bo", "sub"),
                          ("answer", "midia", "main"), ("return", "avon", "sub")]:
        assert tools.parse_chat_action(tools.action_text(tag, arg, chat=True), who) == (tag, arg)


def _record_generate(monkeypatch):
    sampled = []
    real = mgrpo.generate

    def generate(agent, contexts, max_new_tokens, seed, greedy=False, kept=None):
        out = real(agent, contexts, max_new_tokens, seed, greedy, kept)
        sampled.extend((tuple(new), tuple(lp)) for new, lp, _ in out)
        return out
    monkeypatch.setattr(mgrpo, "generate", generate)
    return sampled


def test_chat_training_one_process_trains_on_the_sampled_ids(chat_dir, tmp_path, monkeypatch):
    sampled = _record_generate(monkeypatch)
    trained = []
    real_update = mgrpo.update_agent

    def update_agent(agent, trajs, adv, args, **kw):
        trained.extend(copy.deepcopy(trajs))
        return real_update(agent, trajs, adv, args, **kw)
    monkeypatch.setattr(mgrpo, "update_agent", update_agent)
    s = mgrpo.main(RUN + ["--main-model", chat_dir["main"], "--sub-model", chat_dir["sub"], "--steps", "2",
                          "--out", str(tmp_path)])
    assert s["steps"] == 2
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in rows if "eval" not in r]
    assert sum(r["sub_calls"] for r in steps) > 0  # M delegated: S's loops ran and S trained
    assert any("approx_kl_sub" in r for r in steps)
    samples = {}
    for ids, lps in sampled:  # the same ids may be sampled again, after an update with other log-probs
        samples.setdefault(ids, []).append(lps)
    multi_turn = 0
    for t in trained:
        runs, cur = [], []
        for i, m, lp in zip(t.ids, t.mask, t.logp):  # each mask-1 run is one sampled turn
            if m:
                cur.append((i, lp))
            elif cur:
                runs.append(cur)
                cur = []
        runs += [cur] if cur else []
        for run in runs:
            ids, lps = tuple(i for i, _ in run), tuple(lp for _, lp in run)
            assert lps in samples.get(ids, [])  # the exact ids sampled, with their sampling log-probs
        multi_turn += len(runs) > 1
    assert multi_turn > 0
    # fp32, one epoch: the recomputed log-probs equal the sampling ones (ratio 1)
    for r in steps:
        assert r["approx_kl_main"] < 1e-6 and ("approx_kl_sub" not in r or r["approx_kl_sub"] < 1e-6)
    assert sum("approx_kl_sub" in r for r in steps) > 0  # S trained in some step: its ratio was checked


def test_chat_two_processes(chat_dir, tmp_path):
    store = str(tmp_path / "store")
    common = RUN + ["--steps", "2", "--store", store]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, "mgrpo.py", "--role", role, f"--{role}-model", chat_dir[role],
                               "--out", str(tmp_path / role)] + common,
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for role in ("main", "sub")]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    sub_rows = [json.loads(line) for line in open(tmp_path / "sub" / "metrics.jsonl")]
    main_rows = [json.loads(line) for line in open(tmp_path / "main" / "metrics.jsonl")]
    main_steps = [r for r in main_rows if "eval" not in r]
    assert [r["step"] for r in sub_rows] == [1, 2] and [r["step"] for r in main_steps] == [1, 2]
    assert sum(r["sub_calls"] for r in main_steps) > 0 and sum(r["gen_tokens_sub"] for r in sub_rows) > 0
    assert any("approx_kl_sub" in r for r in sub_rows)
    assert all(r["approx_kl_sub"] < 1e-6 for r in sub_rows if "approx_kl_sub" in r)
    for r in main_steps:
        assert r["approx_kl_main"] < 1e-6


def test_gpu_check_script_dry_run_on_cpu(tmp_path):
    """The GPU check's whole path on a CPU: build, cold start, the two-process run full and with
    LoRA, the samplers side by side (no graphs on a CPU), memory at a tiny shape, the report."""
    report = tmp_path / "report.md"
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu",
                        "--size", "0.1M", "--steps", "2", "--sft-steps", "3", "--questions", "2", "--shape", "tiny",
                        "--out", str(tmp_path), "--report", str(report)], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "full: 2 steps in" in r.stdout and "lora: 2 steps in" in r.stdout and "main: training" in r.stdout
    res = json.load(open(tmp_path / "gpu_check.json"))
    for run in ("full", "lora"):
        assert res[run]["main"]["train_tokens_per_s"] > 0 and res[run]["main"]["params"] > 0
    assert "(a frozen base, LoRA adapters)" in res["lora"]["main"]["estimate"]
    assert res["graphs"]["greedy"]["same_rows"] == 1.0  # eager against eager on a CPU: must agree exactly
    assert res["samplers"]["hf"] > 0 and res["samplers"]["eager"] > 0
    mem = res["memory"]
    assert mem["lora"]["trained"] < mem["masked"]["trained"] / 10 and mem["lora"]["peak_gib"] > 0
    text = report.read_text()
    assert "## The two-process run" in text and "| lora |" in text and "| eager |" in text


def test_chat_tool_loop_searches_visits_and_answers_over_http(chat_dir, monkeypatch):
    """S's loop with scripted chat turns against the toy HTTP server: a search, a visit of a
    result's page, a visit of a page not among its results (refused: an observation, not a
    crash), then the answer."""
    import threading
    srv = toy_server.make_server(0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    args = mgrpo.parse_args(["--max-turns", "4", "4"])
    agent = helpers.load_agent(chat_dir["sub"], args, seed=0)
    q = toy_tools.make_question(5, 1)
    search = tools.HttpSearch(url, retries=0)
    try:
        page = next(r["url"] for r in search.search("ada", q.seed, q.level) if r["title"] == "ada")
        city = toy_tools.knowledge_base(q.seed, q.level)[("city", "ada")]
        script = [tools.action_text("search", "ada", chat=True), tools.action_text("visit", page, chat=True),
                  tools.action_text("visit", url + "/page/5/1/nobody", chat=True),
                  tools.action_text("return", city, chat=True)]
        turns = iter(script)

        def scripted(agent_, contexts, max_new_tokens, seed, greedy=False, kept=None):
            ids = agent_.tok(next(turns), add_special_tokens=False).input_ids + [agent_.end[0]]
            return [(ids, [-0.5] * len(ids), True) for _ in contexts]
        monkeypatch.setattr(mgrpo, "generate", scripted)
        (t,) = mgrpo.run_sub_agents(agent, args, search, ["city of ada"], [q], seed=0)
    finally:
        srv.shutdown()
    assert t.ok and t.result == city
    tool_msgs = agent.tok.decode([i for i, m in zip(t.ids, t.mask) if not m]).split("<tool_response>\n")[1:]
    assert len(tool_msgs) == 3
    assert tool_msgs[0].startswith("[1] ") and "(" + url + "/page/" in tool_msgs[0]   # results with their urls
    assert tool_msgs[1].startswith(f"ada. ada lives {city}.")                          # the page, HTML stripped
    assert tool_msgs[2].startswith("error: cannot visit") and "not among this trajectory's search results" in tool_msgs[2]
    trained = agent.tok.decode([i for i, m in zip(t.ids, t.mask) if m])
    assert trained == "".join(s + "<|im_end|>" for s in script)

