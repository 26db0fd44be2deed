"""The local retriever (retriever.py): BM25 over a corpus in-process and over Search-R1's /retrieve, the
same ranking both ways; hostile corpus lines, caches, requests and replies; both servers answer while
many connections sit idle. Corpora are small and written here; bm25s is an optional install, and the
tests that index need it (CI installs it)."""
import importlib.util
import json
import os
import pickle
import random
import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import requests

import mgrpo
import retriever
import run
import tools
import toy_server
from test_hostile_tools import answer, serving, trickle

needs_bm25s = pytest.mark.skipif(importlib.util.find_spec("bm25s") is None, reason="needs bm25s: pip install bm25s")
WORDS = [a + b for a in ("ka", "lo", "mi", "nu", "pe", "ra", "si", "to") for b in ("b", "d", "g", "l", "m", "n", "r", "s")]
RNG_SEED = 7


def write_corpus(path, n=300, seed=RNG_SEED):
    """n passages of 8 to 30 words (a Zipf-like draw from WORDS); every third line in Search-R1's shape."""
    rng, lines = random.Random(seed), []
    weights = [1 / (i + 1) for i in range(len(WORDS))]
    for i in range(n):
        title, text = " ".join(rng.choices(WORDS, weights, k=2)), " ".join(rng.choices(WORDS, weights, k=rng.randint(8, 30)))
        doc = {"id": f"p{i}", "contents": f"{title}\n{text}"} if i % 3 == 0 else {"id": i, "title": title, "contents": text}
        lines.append(json.dumps(doc))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def queries(n=40, seed=1):
    rng = random.Random(seed)
    return [" ".join(rng.sample(WORDS, rng.randint(1, 3))) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl")


@pytest.fixture(scope="module")
def index(corpus):
    return retriever.Bm25Search(corpus)


@pytest.fixture(scope="module")
def retrieve_url(corpus, index):
    """A /retrieve server of the same corpus, its index loaded from the cache the in-process one built."""
    srv = retriever.make_server(retriever.Bm25Search(corpus))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/retrieve"
    srv.shutdown()
    srv.server_close()


# ---------------------------------------------------------------------------------------
# One ranking, in-process and over HTTP; the run's search tool
# ---------------------------------------------------------------------------------------
@needs_bm25s
def test_in_process_and_http_give_the_same_ranking(index, retrieve_url):
    client, full = retriever.RetrieveClient(retrieve_url, retries=0, timeout=5), 0
    for q in queries():
        local = index.search(q)
        assert client.search(q) == local
        full += len(local) == retriever.TOPK
        raw = requests.post(retrieve_url, json={"queries": [q, "zzz"], "topk": 10, "return_scores": True}).json()
        hits = index.retrieve(q, 10)
        assert [(h["document"]["id"], h["score"]) for h in raw["result"][0]] == [(index.ids[n], s) for n, s in hits]
        assert raw["result"][1] == [] and [s for _, s in hits] == sorted((s for _, s in hits), reverse=True)
    assert full > 30  # most queries fill the top-k: the comparison is not of empty lists
    assert requests.post(retrieve_url, json={"queries": ["kab"]}).json()["result"][0] == [
        {"id": index.ids[n], "contents": index.contents[n]} for n, _ in index.retrieve("kab", retriever.TOPK)]


@needs_bm25s
def test_a_passage_reads_as_its_corpus_line_says(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": "a b/c", "title": "Ada\nLovelace", "contents": "wrote  the first\nprogram"}) + "\n"
                    + json.dumps({"id": 7, "contents": "\"Avon\"\nA river.\nIt flows west."}) + "\n\n")
    search = retriever.Bm25Search(str(path))
    assert search.search("program") == [{"url": "doc://a%20b%2Fc", "title": "Ada Lovelace",
                                         "content": "wrote the first program"}]
    [avon] = search.search("river")
    assert avon == {"url": "doc://7", "title": '"Avon"', "content": "A river. It flows west."}
    assert search.visit(avon["url"], 0, 1, 2000, {avon["url"]}) == '"Avon"\nA river.\nIt flows west.'
    assert search.visit(avon["url"], 0, 1, 5, {avon["url"]}) == '"Avon'
    assert search.search("the") == [] and search.search("nothing here") == []  # a stop word; no shared word
    for url, allowed in (("doc://7", set()), ("doc://8", {"doc://8"})):
        with pytest.raises(tools.SearchError, match="not among|not a passage"):
            search.visit(url, 0, 1, 2000, allowed)


@needs_bm25s
def test_ties_rank_by_corpus_order(tmp_path):
    """Passages of equal score come in the corpus's order, whichever of them a partial sort met first
    (among 1,000, numpy's argpartition alone picks later ones)."""
    lines = [{"id": f"same{i}", "contents": "t\nkab kab mid"} if i % 3 == 1 else
             {"id": f"o{i}", "contents": f"t\nkab lod {i}"} for i in range(1000)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    search = retriever.Bm25Search(str(tmp_path / "c.jsonl"))
    assert [r["url"] for r in search.search("kab")] == ["doc://same1", "doc://same4", "doc://same7"]
    assert [search.ids[n] for n, _ in search.retrieve("kab", 100)] == [f"same{i}" for i in range(1, 300, 3)]


@needs_bm25s
def test_the_run_resolves_bm25_and_retrieve_urls_and_agents_read_the_results(corpus, index, retrieve_url):
    task = run.load_task("toy_tools")
    tool = run.search_tool(mgrpo.parse_args(["--search", f"bm25:{corpus}"]), task)
    client = run.search_tool(mgrpo.parse_args(["--search", retrieve_url + "/"]), task)
    assert type(tool) is retriever.Bm25Search and type(client) is retriever.RetrieveClient
    q = queries(1)[0]
    for search in (tool, client):
        act = tools.tool_calls(search, [task.make_question(3, 1)], chat=True)
        [obs] = act([(0, "search", q)], 0)
        first = index.search(q)[0]
        assert obs.startswith(f"[1] {first['title']} ({first['url']}): {first['content']}") and obs.count("\n") == 2
        assert act([(0, "visit", first["url"])], 1) == [index.contents[index.number[first["url"]]]]
        assert act([(0, "visit", "doc://p999")], 2) == [f"error: {tools.NOT_AMONG.format('doc://p999')}"]
    with pytest.raises(tools.SearchError, match="not reachable.*python retriever.py serve"):
        run.search_tool(mgrpo.parse_args(["--search", "http://127.0.0.1:9/retrieve"]), task)


def test_a_missing_bm25s_is_a_clear_error(corpus, monkeypatch):
    monkeypatch.setitem(sys.modules, "bm25s", None)  # import bm25s raises ImportError
    with pytest.raises(ImportError, match="pip install bm25s"):
        retriever.Bm25Search(corpus)


# ---------------------------------------------------------------------------------------
# Hostile corpora and caches
# ---------------------------------------------------------------------------------------
GOOD = json.dumps({"id": "a", "contents": "t\nsome text"}).encode() + b"\n"


@pytest.mark.parametrize("bad,why", [
    (b"not json", "not JSON"),
    (b"[" * 100_000, "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b'"text"', "not a JSON object"),
    (b'{"contents": "x"}', "'id' must be"),
    (b'{"id": true, "contents": "x"}', "'id' must be"),
    (b'{"id": 1.5, "contents": "x"}', "'id' must be"),
    (b'{"id": ["b"], "contents": "x"}', "'id' must be"),
    (b'{"id": "", "contents": "x"}', "'id' must be"),
    (b'{"id": "b"}', "'contents' must be"),
    (b'{"id": "b", "contents": null}', "'contents' must be"),
    (b'{"id": "b", "contents": ["x"]}', "'contents' must be"),
    (b'{"id": "b", "title": 5, "contents": "x"}', "'title' must be"),
    (b'{"id": "a", "contents": "x"}', "id 'a' is already on line 1"),
    (b'{"id": "b", "contents": "caf\xe9"}', "not UTF-8"),
    (b'{"id": "b", "contents": "' + b"x" * 1_000_001 + b'"}', "longer than 1000000 bytes"),
])
def test_a_malformed_corpus_line_names_the_file_and_the_line(tmp_path, bad, why):
    path = tmp_path / "c.jsonl"
    path.write_bytes(GOOD + b"\n" + bad + b"\n" + GOOD.replace(b'"a"', b'"z"'))
    with pytest.raises(ValueError, match="^" + re.escape(f"{path}, line 3: {why}")):
        retriever.read_corpus(str(path))


def test_an_empty_corpus_is_a_clear_error(tmp_path):
    for data in (b"", b"\n  \n\n"):
        (tmp_path / "c.jsonl").write_bytes(data)
        with pytest.raises(ValueError, match="^" + re.escape(f"{tmp_path / 'c.jsonl'}: no passages")):
            retriever.read_corpus(str(tmp_path / "c.jsonl"))


@needs_bm25s
def test_the_command_line_prints_a_corpus_error(tmp_path):
    (tmp_path / "c.jsonl").write_bytes(GOOD + b"{oops\n")
    r = subprocess.run([sys.executable, "retriever.py", "build", str(tmp_path / "c.jsonl")], capture_output=True,
                       text=True, timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 1 and r.stderr == f"error: {tmp_path / 'c.jsonl'}, line 2: not JSON\n"


class Planted:
    """Unpickling this object creates a file: the proof that a cache was unpickled."""
    marker = ""

    def __reduce__(self):
        return open, (Planted.marker, "w")


def _npy(name):
    return f"{name}.csc.index.npy"


CORRUPTIONS = {
    "a pickle in an array file": lambda d: np.save(d / _npy("data"), np.array([Planted()], dtype=object), allow_pickle=True),
    "a raw pickle as an array file": lambda d: (d / _npy("indices")).write_bytes(pickle.dumps(Planted())),
    "a truncated array": lambda d: (d / _npy("indptr")).write_bytes((d / _npy("indptr")).read_bytes()[:100]),
    "garbage in the manifest": lambda d: (d / "manifest.json").write_text("{"),
    "another corpus's manifest": lambda d: (d / "manifest.json").write_text(
        (d / "manifest.json").read_text().replace('"corpus_sha256": "', '"corpus_sha256": "0')),
    "a passage number past the corpus": lambda d: np.save(d / _npy("indices"), np.load(d / _npy("indices")) + 10 ** 6),
    "a word past the arrays": lambda d: (d / "vocab.index.json").write_text('{"kab": 100000, "": 3}'),
    "a vocabulary that is a list": lambda d: (d / "vocab.index.json").write_text("[1, 2]"),
    "infinite scores": lambda d: np.save(d / _npy("data"), np.full_like(np.load(d / _npy("data")), np.inf)),
    "foreign parameters": lambda d: (d / "params.index.json").write_text('{"backend": "numba", "x": 1}'),
    "other BM25 parameters": lambda d: (d / "params.index.json").write_text(
        (d / "params.index.json").read_text().replace('"k1": 1.5', '"k1": 9.0')),
    "a missing array": lambda d: (d / _npy("indptr")).unlink(),
}


@needs_bm25s
@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_a_corrupt_or_foreign_cache_is_rebuilt_never_unpickled(tmp_path, how, capsys):
    path = write_corpus(tmp_path / "c.jsonl", n=60)
    want = [retriever.Bm25Search(path).search(q) for q in queries(10)]
    assert "indexing 60 passages" in capsys.readouterr().out
    assert [retriever.Bm25Search(path).search(q) for q in queries(10)] == want
    assert "indexing" not in capsys.readouterr().out  # the cache served
    Planted.marker = str(tmp_path / "unpickled")
    CORRUPTIONS[how](tmp_path / "c.jsonl.bm25")
    assert [retriever.Bm25Search(path).search(q) for q in queries(10)] == want
    out = capsys.readouterr().out
    assert f"{tmp_path / 'c.jsonl.bm25'}" in out and "rebuilding" in out and "indexing 60 passages" in out
    assert not os.path.exists(Planted.marker)
    assert [retriever.Bm25Search(path).search(q) for q in queries(10)] == want
    assert "indexing" not in capsys.readouterr().out  # the rebuilt cache serves again


@needs_bm25s
def test_a_changed_corpus_is_indexed_again(tmp_path, capsys):
    path = write_corpus(tmp_path / "c.jsonl", n=60)
    retriever.Bm25Search(path)
    stat = os.stat(path)
    data = open(path, "rb").read().replace(b'"id": 1,', b'"id": 9,')  # the same size, then the same mtime
    open(path, "wb").write(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    capsys.readouterr()
    search = retriever.Bm25Search(path)
    assert "indexing 60 passages" in capsys.readouterr().out
    assert "doc://9" in search.number and "doc://1" not in search.number


@needs_bm25s
def test_an_index_that_cannot_be_cached_is_kept_in_memory(tmp_path, capsys, monkeypatch):
    import bm25s

    def refuse(*args, **kwargs):
        raise PermissionError("read-only")
    monkeypatch.setattr(bm25s.BM25, "save", refuse)
    path = write_corpus(tmp_path / "c.jsonl", n=60)
    assert retriever.Bm25Search(path).search(queries(1)[0])
    assert "cannot cache the index" in capsys.readouterr().out and os.listdir(tmp_path) == ["c.jsonl"]


# ---------------------------------------------------------------------------------------
# The server's hostile requests
# ---------------------------------------------------------------------------------------
@needs_bm25s
@pytest.mark.parametrize("body,code", [
    (b"garbage", 422), (b"[" * 100_000, 422), (b"\xff\xfe\x00", 422), (b"[]", 422), (b"{}", 422),
    (b'{"queries": "kab"}', 422), (b'{"queries": [1]}', 422), (b'{"queries": [["kab"]]}', 422),
    (json.dumps({"queries": ["kab"] * 1025}).encode(), 422), (b'{"queries": ["kab"], "topk": 101}', 422),
    (b'{"queries": ["kab"], "topk": -1}', 422), (b'{"queries": ["kab"], "topk": "3"}', 422),
    (b'{"queries": ["kab"], "topk": 2.0}', 422), (b'{"queries": ["kab"], "topk": true}', 422),
    (b'{"queries": ["kab"], "topk": 1' + b"0" * 5000 + b"}", 422), (b'{"queries": ["kab"], "return_scores": 1}', 422),
    (b'{"queries": ["kab"], "topk": 0}', 200), (b'{"queries": ["kab \\ud800"], "topk": null}', 200),
    (b'{"queries": []}', 200),
])
def test_the_server_answers_malformed_requests_with_422(retrieve_url, body, code):
    r = requests.post(retrieve_url, data=body, timeout=5)
    assert r.status_code == code, r.text
    reply = r.json()
    assert isinstance(reply["detail"], str) if code == 422 else all(len(x) <= retriever.TOPK for x in reply["result"])


@needs_bm25s
def test_the_server_refuses_other_paths_methods_and_big_bodies_at_once(retrieve_url):
    base = retrieve_url.rsplit("/", 1)[0]
    assert requests.post(base + "/search", json={"queries": ["kab"]}, timeout=5).status_code == 404
    assert requests.get(retrieve_url, timeout=5).status_code == 405
    for head, code in ((b"Content-Length: 100000000", b"413"), (b"Content-Length: -5", b"413"),
                       (b"Content-Length: x1", b"411"), (b"X: y", b"411")):  # and no body
        with socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1]))) as s:
            s.sendall(b"POST /retrieve HTTP/1.0\r\n" + head + b"\r\n\r\n")
            s.settimeout(2)
            assert s.recv(100).startswith(b"HTTP/1.0 " + code)


# ---------------------------------------------------------------------------------------
# The client against hostile servers
# ---------------------------------------------------------------------------------------
def reply(result):
    return json.dumps({"result": result})


DOC = {"document": {"id": "d1", "contents": "T\nsome text"}, "score": 1.5}


BAD_REPLIES = [
    "garbage", "", "[" * 100_000, '{"result": ' + "[" * 100_000, "1" * 5000, "null", "[]",
    json.dumps({"results": [[DOC]]}), reply(None), reply({"a": 1}), reply([]), reply([[DOC], [DOC]]), reply([DOC]),
    reply([[DOC] * 4]), reply([["d1"]]), reply([[{"document": "d1", "score": 1}]]),
    reply([[{"document": {"id": "d1"}, "score": 1}]]), reply([[{"document": {"id": "d1", "contents": 5}, "score": 1}]]),
    reply([[{"document": {"id": ["d1"], "contents": "x"}, "score": 1}]]),
    reply([[{"document": {"id": True, "contents": "x"}, "score": 1}]]),
    reply([[{"document": {"id": 1.5, "contents": "x"}, "score": 1}]]),
    reply([[{"document": {"id": "d1", "contents": "x"}}]]), reply([[{"document": {"id": "d1", "contents": "x"}, "score": "1"}]]),
    reply([[{"document": {"id": "d1", "contents": "x"}, "score": True}]]),
    '{"result": [[{"document": {"id": "d1", "contents": "x"}, "score": 1e999}]]}',
    '{"result": [[{"document": {"id": "d1", "contents": "x"}, "score": NaN}]]}',
    '{"result": [[{"document": {"id": "d1", "contents": "x"}, "score": 1' + "0" * 400 + "}]]}",
    '{"result": [[{"document": {"id": "d1", "contents": "x"}, "score": 1' + "0" * 5000 + "}]]}",
]


def test_wrongly_shaped_replies_are_search_errors():
    body = [""]  # what the server sends now
    with serving(lambda h: answer(h, 200, body[0])) as (url, _):
        client = retriever.RetrieveClient(url + "/retrieve", retries=0)
        for bad in BAD_REPLIES:
            body[0] = bad
            with pytest.raises(tools.SearchError, match="no Search-R1-style results"):
                client.search("ada")
                pytest.fail(f"accepted {bad[:100]!r}")
        body[0] = reply([[DOC]])
        assert client.search("ada") == [{"url": "doc://d1", "title": "T", "content": "some text"}]


def test_the_client_posts_search_r1s_request_and_reads_its_reply():
    seen = []

    def respond(h):
        seen.append((h.command, h.path, json.loads(h.body)))
        answer(h, 200, reply([[DOC, {"document": {"contents": "No id\ntext \ud800"}, "score": 0}]]),
               Content_Type="application/json")
    with serving(respond) as (url, _):
        client = retriever.RetrieveClient(url + "/retrieve/", retries=0)
        results = client.search("ada \ud800")
    assert seen == [("POST", "/retrieve", {"queries": ["ada ?"], "topk": retriever.TOPK, "return_scores": True})]
    url2 = f"doc://{tools.stable_seed('No id' + chr(10) + 'text ' + chr(0xd800)):08x}"  # no id: named by its text
    assert results == [{"url": "doc://d1", "title": "T", "content": "some text"},
                       {"url": url2, "title": "No id", "content": "text ?"}]
    assert client.visit("doc://d1", allowed={"doc://d1"}) == "T\nsome text"
    assert client.visit(url2, allowed={url2}) == "No id\ntext ?"
    for url, allowed in (("doc://d1", ()), ("doc://d2", {"doc://d2"})):
        with pytest.raises(tools.SearchError, match="not among|not a passage this retriever returned"):
            client.visit(url, allowed=allowed)


def test_huge_slow_failing_and_absent_servers():
    with serving(trickle) as (url, _):
        t0 = time.monotonic()
        with pytest.raises(tools.SearchError, match="Timeout"):
            retriever.RetrieveClient(url + "/retrieve", timeout=0.5, retries=0).search("ada")
        assert time.monotonic() - t0 < 1.5
    with serving(lambda h: answer(h, 200, reply([[DOC]]) + " " * 3_000_000)) as (url, _):
        with pytest.raises(tools.SearchError, match="over 2000000 bytes"):
            retriever.RetrieveClient(url + "/retrieve", retries=0).search("ada")
    with serving(lambda h: answer(h, 200, b"\x1f\x8b" + b"\0" * 100, Content_Encoding="gzip")) as (url, _):
        with pytest.raises(tools.SearchError, match="compressed"):
            retriever.RetrieveClient(url + "/retrieve", retries=0).search("ada")
    with serving(lambda h: answer(h, 500 if H.calls < 3 else 200, reply([[DOC]]))) as (url, H):
        assert retriever.RetrieveClient(url + "/retrieve", retries=2, backoff=0.05).search("ada")[0]["url"] == "doc://d1"
        assert H.calls == 3
        H.calls = 0
        with pytest.raises(tools.SearchError, match="answered 500.*after 2 tries"):
            retriever.RetrieveClient(url + "/retrieve", retries=1, backoff=0.05).search("ada")
    with serving(lambda h: answer(h, 422, '{"detail": "no"}')) as (url, _):
        with pytest.raises(tools.SearchError, match="answered 422"):
            retriever.RetrieveClient(url + "/retrieve", retries=0).search("ada")
    t0 = time.monotonic()
    with pytest.raises(tools.SearchError, match="not reachable"):
        retriever.RetrieveClient("http://127.0.0.1:9/retrieve", retries=1, backoff=0.05).search("ada")
    assert time.monotonic() - t0 < 3


# ---------------------------------------------------------------------------------------
# Both servers keep answering while many connections sit idle
# ---------------------------------------------------------------------------------------
def _toy_server(corpus):
    return toy_server.make_server(0), lambda url: tools.HttpSearch(url, retries=0, timeout=10).search("ada", 1, 1), \
        b"GET /search?q=ada&kb=1 HT"


def _retrieval_server(corpus):
    return retriever.make_server(retriever.Bm25Search(corpus)), \
        lambda url: retriever.RetrieveClient(url + "/retrieve", retries=0, timeout=10).search("kab"), \
        b"POST /retrieve HTTP/1.0\r\nContent-Length: 100\r\n\r\n{\"queries\""


@pytest.mark.parametrize("kind", [_toy_server, pytest.param(_retrieval_server, marks=needs_bm25s)])
def test_both_servers_answer_while_65_connections_idle_or_half_sent(kind, corpus):
    """65 connections, 33 silent and 32 that sent half a request: a client's answer comes in a few
    seconds, well before the servers' 10 s of silence would close them."""
    srv, search, half = kind(corpus)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url, held = f"http://127.0.0.1:{srv.server_address[1]}", []
    try:
        for i in range(65):
            held.append(socket.create_connection(("127.0.0.1", srv.server_address[1])))
            if i % 2:
                held[-1].sendall(half)
        time.sleep(0.5)  # all accepted
        for _ in range(3):
            t0 = time.monotonic()
            assert search(url)
            assert time.monotonic() - t0 < 3
    finally:
        for s in held:
            s.close()
        srv.shutdown()
        srv.server_close()


# ---------------------------------------------------------------------------------------
# Outside text, bounded: ids, titles, what the client keeps, what the server computes
# ---------------------------------------------------------------------------------------
def test_any_id_makes_a_url_and_a_long_one_a_short_unique_url():
    """A lone surrogate in an id made doc_url raise UnicodeEncodeError; an id is never cut into another's url."""
    urls = {retriever.doc_url(i) for i in ("a\ud800b", "a\udc00b", "a?b", 7, "7 ", "x" * 100, "x" * 101)}
    assert len(urls) == 7 and all(len(u) < 6 + 3 * retriever.ID_CHARS + 20 for u in urls)
    assert retriever.doc_url("p1") == "doc://p1" and retriever.doc_url(3) == "doc://3"  # short ids as before


def test_a_huge_title_or_id_gives_a_bounded_result():
    """A 200 kB title made a 225,129-character search result; now a result is bounded whatever its passage."""
    r = retriever.passage_result("i" * 300_000, "T" * 200_000 + "\n" + "word " * 100_000)
    assert len(r["title"]) == retriever.TITLE_CHARS and len(r["url"]) < 100 and len(r["content"]) <= retriever.SNIPPET_CHARS
    assert r["content"].startswith("word word")  # the text after a long title is still the passage's text
    obs = tools.search_observation([r] * 3, chat=True)
    assert len(obs) < 3 * (retriever.TITLE_CHARS + retriever.SNIPPET_CHARS + 150)


def test_the_client_keeps_what_visit_reads_of_the_passages_returned_last(monkeypatch):
    """RetrieveClient keeps VISIT_CHARS of a passage (all that visit reads), and forgets the least recently
    returned: a passage returned again is kept, whatever came between (first-in, first-out lost it)."""
    monkeypatch.setattr(retriever, "RECENT", 5)
    replies = iter([[{"id": "keep", "contents": "T\n" + "k" * 50_000}]] + [[{"id": f"n{i}", "contents": "T\nx"}]
                   for i in range(4)] + [[{"id": "keep", "contents": "T\n" + "k" * 50_000}]] + [[{"id": f"m{i}", "contents": "T\ny"}]
                   for i in range(4)])

    def respond(h):
        docs = next(replies)
        answer(h, 200, json.dumps({"result": [[{"document": d, "score": 1.0} for d in docs]]}))
    with serving(respond) as (url, _):
        client = retriever.RetrieveClient(url + "/retrieve", timeout=5.0, retries=0)
        for _ in range(10):
            client.search("q")
    assert "doc://keep" in client.passages and len(client.passages) == 5
    assert max(map(len, client.passages.values())) <= tools.VISIT_CHARS
    assert client.visit("doc://keep", allowed=("doc://keep",)) == ("T\n" + "k" * 50_000)[:tools.VISIT_CHARS]


@needs_bm25s
def test_the_server_bounds_a_requests_work_and_stops_after_its_cut(corpus, monkeypatch):
    """1,024 queries x top 100 in one request is refused; a request still computing when its connection's
    total deadline passes stops (it went on computing after the cut)."""
    index = retriever.Bm25Search(corpus)
    calls, real = [], index.retrieve
    index.retrieve = lambda q, k: calls.append(q) or time.sleep(0.05) or real(q, k)
    monkeypatch.setattr(retriever._Handler, "total_timeout", 0.5)
    srv = retriever.make_server(index)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/retrieve"
    try:
        r = requests.post(url, json={"queries": ["kab"] * 1024, "topk": 100}, timeout=10)
        assert r.status_code == 422 and f"at most {retriever.MAX_RESULTS} results" in r.text and not calls
        with pytest.raises(requests.exceptions.RequestException):
            requests.post(url, json={"queries": ["kab"] * 200, "topk": 3}, timeout=10)
        time.sleep(0.3)
        assert 1 <= len(calls) <= 16  # about 0.5 s of 0.05 s queries (fewer on a busy machine), not 200
    finally:
        srv.shutdown()
        srv.server_close()


@needs_bm25s
def test_a_corpus_without_a_word_to_index_names_its_file(tmp_path):
    path = tmp_path / "stop.jsonl"
    path.write_text("".join(json.dumps({"id": i, "contents": t}) + "\n" for i, t in enumerate(["the a of", "!!! ...", "and"])))
    with pytest.raises(ValueError, match=r"stop.jsonl: no passage holds a word to index"):
        retriever.Bm25Search(str(path))


@needs_bm25s
@pytest.mark.parametrize("error", [OSError("disk full"), RuntimeError("bm25s failed")])
def test_a_failed_or_killed_index_build_leaves_no_temporary_folder(tmp_path, monkeypatch, error, capsys):
    import bm25s
    path = write_corpus(tmp_path / "c.jsonl", n=30)
    stale = tmp_path / tools.temporary_name("c.jsonl.bm25").replace(f"-{os.getpid()}-", "-999999999-")  # killed
    (stale / "sub").mkdir(parents=True)
    live = tmp_path / tools.temporary_name("c.jsonl.bm25").replace(f"-{os.getpid()}-", f"-{os.getppid()}-")
    other = tmp_path / tools.temporary_name("c.jsonl.bm25").replace(".tmp-", ".tmp-otherhost").replace(
        f"-{os.getpid()}-", "-999999999-")  # another host's, on a shared disk: not judged here
    live.mkdir()
    other.mkdir()
    real = bm25s.BM25.save

    def save(self, folder, **kw):
        real(self, folder, **kw)  # written whole, then the failure
        raise error
    monkeypatch.setattr(bm25s.BM25, "save", save)
    if isinstance(error, OSError):
        assert retriever.Bm25Search(path).search("kab")  # kept in memory, with a message
        assert "kept in memory only" in capsys.readouterr().out
    else:
        with pytest.raises(RuntimeError):
            retriever.Bm25Search(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["c.jsonl", live.name, other.name])
