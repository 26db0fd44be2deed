"""The toy task: fresh worlds, the search tool in-process and over HTTP, reward checkers."""
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import tiny_models
import tools
import toy_tools as tt


def test_every_question_has_its_own_world():
    qs = [tt.make_question(s, 1) for s in range(50)]
    kbs = [tt.knowledge_base(s, 1) for s in range(50)]
    assert len({tuple(sorted(kb.items())) for kb in kbs}) == 50
    for q, kb in zip(qs, kbs):
        x = q.text.split()[-2]
        assert q.answer == kb[("country", kb[("city", x)])]
    assert tt.make_question(7, 2) == tt.make_question(7, 2)
    with pytest.raises(ValueError):
        tt.make_question(1, 4)


def test_search_returns_the_fact_among_distractors():
    for level in (1, 2):
        q = tt.make_question(5, level)
        kb = tt.knowledge_base(5, level)
        x = q.text.split()[-2]
        res = tt.search_results(5, level, x)
        assert len(res) == tt.N_SNIPPETS[level]
        assert tt.fact_text("city", x, kb[("city", x)]) in [r["content"] for r in res]
    # level 1 is clean: no distractor shares the relation of the hit
    res = tt.search_results(5, 1, "ada")
    assert sum(" lives " in r["content"] for r in res) == 1
    assert tt.search_results(5, 1, "nobody")  # unknown entity: distractors only, no crash


def test_level_2_results_are_long_and_noisy():
    """Level 2: eight snippets; the fact asked for is the only one of its relation about
    its entity, among facts that name the entity as a value and facts about others."""
    mentions = 0
    for seed in range(30):
        kb = tt.knowledge_base(seed, 2)
        x = tt.make_question(seed, 2).text.split()[-2]
        y = kb[("friend", x)]
        for rel, entity in (("friend", x), ("city", y), ("country", kb[("city", y)])):
            res = [r["content"] for r in tt.search_results(seed, 2, entity)]
            assert len(res) == tt.N_SNIPPETS[2] > tt.N_SNIPPETS[1]
            word = tt.RELATIONS[rel][0]
            assert [c for c in res if c.split()[:2] == [entity, word]] == [tt.fact_text(rel, entity, kb[(rel, entity)])]
            mentions += sum(c.split()[-1] == entity for c in res)
    assert mentions > 20  # "bo lives avon" comes up when searching "avon"


def test_in_process_and_http_agree(server_url):
    local, http = tt.ToySearch(), tools.HttpSearch(server_url)
    for seed, level, query in [(1, 1, "ada"), (2, 2, "bo"), (3, 1, "avon"), (4, 2, "city of ada"), (5, 1, "???")]:
        over_http = http.search(query, seed, level)
        for r in over_http:  # the server points the results at its own pages, which name the world
            assert r["url"] == f"{server_url}/page/{seed}/{level}/{r['title']}"
            r["url"] = f"toy://page/{r['title']}"  # in-process, the visit is told the world
        assert local.search(query, seed, level) == over_http


def test_visit_reads_a_result_page_in_process_and_over_http(server_url):
    local, http = tt.ToySearch(), tools.HttpSearch(server_url, retries=0)
    for seed, level, query in [(1, 1, "ada"), (2, 2, "bo"), (3, 2, "avon")]:
        for a, b in zip(local.search(query, seed, level), http.search(query, seed, level)):
            page = http.visit(b["url"], allowed={b["url"]})  # a URL of the trajectory's own results
            assert page == local.visit(a["url"], seed, level, allowed=[a["url"]]) and b["content"] + "." in page
    assert len(http.visit(b["url"], max_chars=7, allowed=[b["url"]])) == 7
    for bad in ("file:///etc/passwd", "toy://page/1/1/ada", "ftp://x"):
        with pytest.raises(tools.SearchError, match="only http"):
            http.visit(bad, allowed=[bad])
    nobody = server_url + "/page/1/1/nobody"
    with pytest.raises(tools.SearchError, match="404"):
        http.visit(nobody, allowed=[nobody])
    with pytest.raises(tools.SearchError, match="not a page"):
        local.visit("http://example.com/", 1, 1, allowed=["http://example.com/"])
    with pytest.raises(tools.SearchError, match="not a page"):  # a world of no level
        local.visit("toy://page/ada", 1, 7, allowed=["toy://page/ada"])
    html = "<html><head><title>T</title><style>p {}</style></head><body><script>x()</script><p>a &amp; b</p>c</body>"
    assert tools.html_text(html) == "a & b c"


def test_http_bad_request_and_down_server(server_url):
    import requests
    r = requests.get(f"{server_url}/search", params={"q": "ada", "kb": "x"}, timeout=5)
    assert r.status_code == 400 and "error" in r.json()
    with pytest.raises(RuntimeError, match="answered 400"):
        tools.HttpSearch(server_url).search("ada", 1, 7)
    with pytest.raises(RuntimeError, match="not reachable"):
        tools.HttpSearch("http://127.0.0.1:9", timeout=2).search("ada", 1, 1)


def serve(handler):
    """A throwaway HTTP server on 127.0.0.1 with the given GET handler; returns (url, server)."""
    class H(BaseHTTPRequestHandler):
        calls = 0

        def do_GET(self):
            H.calls += 1
            code, body = handler(H.calls)
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass
    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{srv.server_address[1]}", srv, H


def test_http_client_retries_server_errors_then_succeeds():
    ok = json.dumps({"results": [{"url": "u", "title": "t", "content": "ada lives avon"}, {"url": "v"}]})
    url, srv, h = serve(lambda n: (503, "busy") if n < 3 else (200, ok))
    try:
        res = tools.HttpSearch(url, timeout=5, retries=2, backoff=0.01).search("ada", 1, 1)
    finally:
        srv.shutdown()
    assert h.calls == 3
    assert res == [{"url": "u", "title": "t", "content": "ada lives avon"}, {"url": "v", "title": "", "content": ""}]


def test_http_client_errors_are_clear_and_not_retried_when_final():
    url, srv, h = serve(lambda n: (404, "no such thing"))
    try:
        with pytest.raises(tools.SearchError, match="answered 404"):
            tools.HttpSearch(url, retries=3, backoff=0.01).search("ada", 1, 1)
        assert h.calls == 1  # a 4xx is the request's fault: retrying would not help
    finally:
        srv.shutdown()
    url, srv, h = serve(lambda n: (200, "<html>not json</html>"))
    try:
        with pytest.raises(tools.SearchError, match="no SearXNG-style results"):
            tools.HttpSearch(url).search("ada", 1, 1)
    finally:
        srv.shutdown()


def test_http_client_gives_up_on_a_hanging_server():
    def hang(n):
        time.sleep(2.0)
        return 200, json.dumps({"results": []})
    url, srv, h = serve(hang)
    try:
        t0 = time.time()
        with pytest.raises(tools.SearchError, match="Timeout"):
            tools.HttpSearch(url, timeout=0.2, retries=1, backoff=0.01).search("ada", 1, 1)
        assert time.time() - t0 < 1.5 and h.calls == 2
    finally:
        srv.shutdown()


def test_reward_checkers():
    q = tt.make_question(9, 2)
    kb = tt.knowledge_base(9, 2)
    assert tt.answer_correct(q, q.answer) and not tt.answer_correct(q, "ada") and not tt.answer_correct(q, None)
    assert tt.expert_score(q, "friend of ada", kb[("friend", "ada")], []) == 1.0
    assert tt.expert_score(q, "city of ada", "nowhere", ["nowhere"]) == 0.0
    assert tt.expert_score(q, "country of ada", "x", []) == 0.0  # ada is no city: asks for nothing
    assert tt.expert_score(q, "banana", "x", []) == 0.0
    assert tt.expert_score(q, "city of ada", None, []) == 0.0
    # what chat models write: capitals, punctuation
    assert tt.answer_correct(q, " " + q.answer.capitalize()) and tt.expert_score(q, "City of Ada", kb[("city", "ada")].upper(), [])
    assert tt.fact_text("city", "ada", kb[("city", "ada")]) in [r["content"] for r in tt.search_results(9, 2, "Ada?")]


def test_noisy_demos_are_noisy_and_in_vocabulary():
    tok = tiny_models.word_tokenizer(tt.WORDS)
    rng = random.Random(0)
    right = []
    for s in range(400):
        q = tt.make_question(s, 1 + s % 2)
        msgs = tt.main_demo(q, rng, 0.1)
        right.append(tt.answer_correct(q, tools.parse_action(msgs[-1]["content"], tools.TAGS["main"])[1]))
        for m in msgs + tt.sub_demo(q, rng, 0.1):
            assert tok.unk_token_id not in tok(m["content"]).input_ids
    assert 0.55 < sum(right) / len(right) < 0.85  # about a third of the demos end wrong
    assert all(tt.answer_correct(q, tt.main_demo(q, rng, 0.0)[-1]["content"].split()[1])
               for q in [tt.make_question(s, 2) for s in range(20)])


@pytest.mark.parametrize("chat", [False, True])
def test_demos_quote_the_fact_they_read_before_acting_on_it(chat):
    """A sub-agent's (and single agent's) demo thinks the fact it read, as it stands in the tool
    message before, then acts on its value; the turn still parses to that action. The main agent's
    demo, which reads one word back, has no thought."""
    quoted = 0
    parse = (lambda text, kind: tools.parse_chat_action(text, kind)) if chat else \
        (lambda text, kind: tools.parse_action(text, tools.TAGS[kind]))
    for s in range(60):
        q, rng = tt.make_question(s, 1 + s % 3), random.Random(s)
        for kind in ("sub", "single", "main"):
            msgs = tt.demo(q, rng, 0.0, kind, chat=chat)
            for before, turn in zip(msgs, msgs[1:]):
                if turn["role"] != "assistant" or "<think>" not in turn["content"]:
                    continue
                assert kind != "main" and before["role"] == "tool"
                fact = turn["content"].split("<think>")[1].split("</think>")[0].strip()
                assert fact in before["content"]  # read, not made up
                tag, arg = parse(turn["content"], kind)
                assert arg == fact.split()[-1] and tag in ("search", "return", "answer")
                quoted += 1
    assert quoted > 100


def test_the_value_asked_for_is_named_once_in_its_list():
    """Along every hop of a question, the search for the entity lists the fact asked for, and no other
    snippet names its value: a model must read the fact, not count which word comes up twice."""
    for level in (2, 3):
        for s in range(100):
            q, kb = tt.make_question(s, level), tt.knowledge_base(s, level)
            x = q.text.split()[-2]
            for rel in tt.chain(level):
                snippets = [r["content"] for r in tt.search_results(s, level, x)]
                assert tt.fact_text(rel, x, kb[(rel, x)]) in snippets
                assert sum(kb[(rel, x)] in c.split() for c in snippets) == 1, (level, s, rel, snippets)
                x = kb[(rel, x)]
