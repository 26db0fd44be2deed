"""A local retriever, as search-agent RL runs use one: BM25 (the bm25s package) over a corpus of
passages, searched in-process or served over HTTP with Search-R1's API.

    pip install bm25s                                     # optional: only this module needs it
    python retriever.py build corpus.jsonl                # the index, cached in corpus.jsonl.bm25/
    python retriever.py serve corpus.jsonl --port 8000    # POST http://127.0.0.1:8000/retrieve
    python mgrpo.py --search bm25:corpus.jsonl            # in-process
    python mgrpo.py --search http://127.0.0.1:8000/retrieve

The corpus holds one JSON object a line: {"id", "title", "contents"}, or Search-R1's {"id", "contents"},
whose first line of contents is the title and the rest the text. An id is a string or an integer.

A search returns the TOPK best passages that share a word with the query (BM25, English stop words out),
as the tools' results: {"url": "doc://<id>", "title", "content": the text cut to SNIPPET_CHARS}; `visit`
of such a url, among the trajectory's own results, reads the passage (title, newline, text).

The server speaks Search-R1's POST /retrieve: {"queries": [str, ...], "topk": k, "return_scores": bool}
-> {"result": [[{"document": {"id", "contents"}, "score": float}, ...], ...]}, one list per query
(without return_scores: the documents alone); a topk of 0 or none means TOPK; a malformed request is
422 {"detail": ...}. `--search URL` with a URL that ends in /retrieve reaches it, or Search-R1's own.

The index is cached next to the corpus and rebuilt when the corpus's bytes change (a SHA-256) or the
cache is unusable; the cache is read without pickle and checked before use.
"""
import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import time
from http.server import BaseHTTPRequestHandler
from urllib.parse import quote, urlparse

import numpy as np

from tools import (NOT_AMONG, VISIT_CHARS, HttpSearch, SearchError, clean_text, json_lines, stable_seed,
                   sweep_temporary, temporary_name)
from toy_server import DeadlineHandler, Server

TOPK = 3             # passages per search, as Search-R1 trains with
SNIPPET_CHARS = 600  # a result's text is cut to this: a whole 100-word passage (Search-R1's Wikipedia chunks)
MAX_LINE = 1_000_000  # bytes of one corpus line
TITLE_CHARS, ID_CHARS = 200, 64  # a result's title is cut to this; a longer id is cut and given its hash (doc_url)
MAX_TOPK, MAX_QUERIES, MAX_BODY = 100, 1024, 1_000_000  # what one /retrieve request may ask
MAX_RESULTS, MAX_REPLY = MAX_QUERIES * TOPK, 50_000_000  # queries x topk, and bytes, of one /retrieve reply
RECENT = 10_000  # RetrieveClient: the passages it keeps for `visit`, the ones returned last
CACHE_FORMAT = 1     # the cache's manifest names it; another value is rebuilt


def _bm25s():
    try:
        import bm25s
    except ImportError:
        raise ImportError("a bm25: search needs the bm25s package, an optional install: pip install bm25s") from None
    return bm25s


def passage_result(doc_id, contents):
    """A passage as a search result: the first line of contents is its title (cut to TITLE_CHARS), the rest its
    text (cut to SNIPPET_CHARS)."""
    cut = contents.find("\n")  # the title and the text each cut before they are split (linear in contents)
    title, text = (contents, "") if cut < 0 else (contents[:cut], contents[cut + 1:cut + 1 + 4 * SNIPPET_CHARS])
    title = title[:4 * TITLE_CHARS]
    url = doc_url(doc_id if doc_id is not None else f"{stable_seed(contents):08x}")  # a server may send no id
    return {"url": url, "title": clean_text(" ".join(title.split())[:TITLE_CHARS]),
            "content": clean_text(" ".join(text.split())[:SNIPPET_CHARS])}


def doc_url(doc_id):
    """A passage's url: its id, quoted, so that a model's tool call (whitespace collapsed) names it whole; any
    string at all (a lone surrogate's bytes are quoted too). An id over ID_CHARS is cut, with a hash of it all."""
    raw = str(doc_id).encode("utf-8", "surrogatepass")
    if len(raw) > ID_CHARS:
        raw = raw[:ID_CHARS] + b"~" + hashlib.sha256(raw).hexdigest()[:16].encode()
    return "doc://" + quote(raw, safe="")


# ---------------------------------------------------------------------------------------
# The corpus and its index
# ---------------------------------------------------------------------------------------
def read_corpus(path):
    """(ids, contents, SHA-256 of the file) of a corpus: contents is 'title\\ntext', the title on one line.
    A malformed line is a ValueError naming the file and the line."""
    ids, contents, line_of, digest = [], [], {}, hashlib.sha256()
    for n, where, doc in json_lines(path, MAX_LINE, digest):
        doc_id, title, text = _passage(doc, where)
        if doc_id in line_of:
            raise ValueError(f"{where}: id {doc_id[:100]!r} is already on line {line_of[doc_id]}")
        line_of[doc_id] = n
        ids.append(doc_id)
        contents.append(" ".join(title.split()) + "\n" + text)
    if not ids:
        raise ValueError(f"{path}: no passages (one JSON object a line: id, title, contents)")
    return ids, contents, digest.hexdigest()


def _passage(doc, where):
    """(id, title, text) of one corpus line's object: {"id", "title", "contents"} or {"id", "contents"}."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: not a JSON object")
    doc_id, title, text = doc.get("id"), doc.get("title"), doc.get("contents")
    if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)) or doc_id == "":
        raise ValueError(f"{where}: 'id' must be a non-empty string or an integer")
    if not isinstance(text, str):
        raise ValueError(f"{where}: 'contents' must be a string")
    if title is None:
        title, _, text = text.partition("\n")
    elif not isinstance(title, str):
        raise ValueError(f"{where}: 'title' must be a string")
    return str(doc_id), title, text


def load_index(folder, manifest):
    """The cached index in folder if it was built from this corpus (manifest) and is sound, else None."""
    if not os.path.exists(os.path.join(folder, "manifest.json")):
        return None
    bm25s = _bm25s()
    try:  # an untrusted folder can fail in many ways: each one means a rebuild, none runs its code
        with open(os.path.join(folder, "manifest.json"), "rb") as f:
            if json.loads(f.read(100_000)) != manifest:
                print(f"bm25: {folder} holds the index of another corpus or version: rebuilding", flush=True)
                return None
        model = bm25s.BM25.load(folder, allow_pickle=False, mmap=False, load_corpus=False, show_progress=False)
        check_index(model, manifest["passages"])
        return model
    except Exception as e:  # noqa: BLE001
        print(f"bm25: the index cache {folder} is unusable ({type(e).__name__}: {str(e)[:200]}): rebuilding",
              flush=True)
        return None


def check_index(model, n_docs):
    """ValueError unless the index's arrays are of the shape and range that bm25s's scoring reads."""
    s = model.scores
    data, indices, indptr, vocab = s["data"], s["indices"], s["indptr"], model.vocab_dict
    ok = (s["num_docs"] == n_docs
          and (model.method, model.idf_method, model.k1, model.b) == ("lucene", "lucene", 1.5, 0.75)
          and all(isinstance(a, np.ndarray) and a.ndim == 1 for a in (data, indices, indptr))
          and data.dtype.kind == "f" and indices.dtype.kind in "iu" and indptr.dtype.kind in "iu"
          and len(indptr) == len(vocab) and len(data) == len(indices) == int(indptr[-1]) and indptr[0] == 0
          and bool(np.all(np.diff(indptr) >= 0)) and bool(np.isfinite(data).all())
          and (len(indices) == 0 or 0 <= int(indices.min()) <= int(indices.max()) < n_docs)
          and all(isinstance(k, str) and type(v) is int and 0 <= v < len(indptr) - (k != "")
                  for k, v in vocab.items()))
    if not ok:
        raise ValueError("its arrays or vocabulary do not fit the corpus")


def build_index(folder, contents, manifest):
    """Index the passages and save the index in folder (written aside, then renamed in)."""
    bm25s = _bm25s()
    print(f"bm25: indexing {len(contents)} passages into {folder} ...", flush=True)
    t0 = time.time()
    model, tokens = bm25s.BM25(), bm25s.tokenize(contents, show_progress=False)  # no bars amid the run's lines
    if not tokens.vocab:
        raise ValueError(f"{folder[:-len('.bm25')]}: no passage holds a word to index (each is stop words and "
                         "punctuation)")
    model.index(tokens, show_progress=False)
    tmp = temporary_name(folder)
    sweep_temporary(folder)
    try:
        model.save(tmp, show_progress=False)
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f)
        shutil.rmtree(folder, ignore_errors=True)
        os.rename(tmp, folder)  # fails if another process renamed its own in first: the same index
    except OSError as e:  # e.g. a read-only corpus folder
        if load_index(folder, manifest) is None:
            print(f"bm25: cannot cache the index in {folder} ({e}); it is kept in memory only", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"bm25: indexed in {time.time() - t0:.1f} s", flush=True)
    return model


class Bm25Search:
    """The search tool over a corpus, in-process (--search bm25:<corpus.jsonl>); seed and level are
    unused: a corpus is one world for every question."""

    def __init__(self, corpus):
        bm25s = _bm25s()
        self.ids, self.contents, digest = read_corpus(corpus)
        self.number = {doc_url(i): n for n, i in enumerate(self.ids)}  # url -> passage
        manifest = {"format": CACHE_FORMAT, "corpus_sha256": digest, "passages": len(self.ids),
                    "bm25s": bm25s.__version__}
        folder = corpus + ".bm25"
        self.model = load_index(folder, manifest)
        if self.model is None:
            self.model = build_index(folder, self.contents, manifest)

    def retrieve(self, query, k):
        """[(passage number, score)] of the k best passages that share a word with the query, best first."""
        words = _bm25s().tokenize(clean_text(query), return_ids=False, show_progress=False)[0]
        ids = self.model.get_tokens_ids(words)
        if not ids:
            return []
        scores = self.model.get_scores_from_ids(ids)
        k = min(k, len(scores))
        kth = scores[np.argpartition(-scores, k - 1)[k - 1]]  # the k-th best score (np.partition: slow on many 0s)
        top = np.flatnonzero(scores >= kth) if kth > 0 else np.flatnonzero(scores > 0)  # every tie of the k-th
        top = top[np.lexsort((top, -scores[top]))][:k]  # best first; a tie: the earlier passage first
        return [(int(n), float(scores[n])) for n in top]

    def search(self, query, seed=None, level=None):
        return [passage_result(self.ids[n], self.contents[n]) for n, _ in self.retrieve(query, TOPK)]

    def visit(self, url, seed=None, level=None, max_chars=VISIT_CHARS, allowed=()):
        if url not in allowed:
            raise SearchError(NOT_AMONG.format(url[:200]))
        if url not in self.number:
            raise SearchError(f"cannot visit {url[:200]!r}: not a passage of this corpus")
        return clean_text(self.contents[self.number[url]][:max_chars])


# ---------------------------------------------------------------------------------------
# Search-R1's /retrieve: the server and the client
# ---------------------------------------------------------------------------------------
def parse_request(body):
    """(queries, topk, return_scores) of a /retrieve request's body; ValueError if it is malformed."""
    try:
        req = json.loads(body)
    except (ValueError, RecursionError):
        raise ValueError("the body is not JSON") from None
    if not isinstance(req, dict) or not isinstance(req.get("queries"), list) or \
            not all(isinstance(q, str) for q in req["queries"]) or len(req["queries"]) > MAX_QUERIES:
        raise ValueError(f"'queries' must be a list of at most {MAX_QUERIES} strings")
    topk = req.get("topk") or TOPK  # none or 0: the default, as Search-R1's server
    if type(topk) is not int or not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"'topk' must be an integer from 1 to {MAX_TOPK}")
    if not isinstance(req.get("return_scores", False), bool):
        raise ValueError("'return_scores' must be true or false")
    return req["queries"], topk, req.get("return_scores", False)


class _Handler(DeadlineHandler):
    log_message = BaseHTTPRequestHandler.log_message  # a line a request on stderr, as a server's log has it

    def do_POST(self):
        if urlparse(self.path).path != "/retrieve":
            return self.reply(404, {"detail": "Not Found"})
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            return self.reply(411, {"detail": "a Content-Length is needed"})
        if not 0 <= length <= MAX_BODY:
            return self.reply(413, {"detail": f"a body of at most {MAX_BODY} bytes"})
        body = self.rfile.read(length)  # under the connection's deadlines
        if len(body) < length:
            return None
        self.server.working(self.request)
        try:
            queries, k, with_scores = parse_request(body)
        except ValueError as e:
            return self.reply(422, {"detail": str(e)})
        if len(queries) * k > MAX_RESULTS:
            return self.reply(422, {"detail": f"at most {MAX_RESULTS} results a request (queries x topk)"})
        index, result, size = self.server.index, [], 0
        for query in queries:
            if time.monotonic() > self.cut_at:  # the connection was cut: nobody reads the rest
                return None
            docs = [({"id": index.ids[n], "contents": index.contents[n]}, score)
                    for n, score in index.retrieve(query, k)]
            result.append([{"document": d, "score": s} if with_scores else d for d, s in docs])
            size += len(json.dumps(result[-1]))  # as sent: escapes count
            if size > MAX_REPLY:
                return self.reply(422, {"detail": f"the results pass {MAX_REPLY} bytes: ask for fewer"})
        return self.reply(200, {"result": result})

    def do_GET(self):
        self.reply(405, {"detail": "Method Not Allowed"})

    def reply(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def make_server(index, host="127.0.0.1", port=0):
    """A /retrieve server of index (a Bm25Search) on host:port (0: any free port); call .serve_forever()."""
    srv = Server((host, port), _Handler)
    srv.index = index
    return srv


class RetrieveClient(HttpSearch):
    """The search tool on a server with Search-R1's POST /retrieve (--search http://HOST:PORT/retrieve): this
    module's or Search-R1's own. HttpSearch's guarantees hold: a total deadline, a size cap, retries with
    backoff, no decompression; a reply not of the shape (types, lengths, nesting, numbers) is a SearchError.
    The API has no pages: `visit` reads a passage that this client's searches returned (the last RECENT)."""

    def __init__(self, url, **kw):
        super().__init__(url, **kw)
        self.passages = {}  # url -> contents, of the passages returned lately

    def search(self, query, seed=None, level=None):
        payload = {"queries": [clean_text(query)], "topk": TOPK, "return_scores": True}
        r, text, over = self._request(self.url, {}, f"retriever {self.url}", payload)
        if r.status_code != 200:
            raise SearchError(f"retriever {self.url} answered {r.status_code}: {text[:200]}")
        if over:
            raise SearchError(f"retriever {self.url} sent over {self.max_bytes} bytes")
        results = []
        for doc in _documents(text):
            results.append(passage_result(doc.get("id"), doc["contents"]))
            self.passages.pop(results[-1]["url"], None)  # returned again: the most recent now
            self.passages[results[-1]["url"]] = doc["contents"][:VISIT_CHARS]  # all that visit reads
        while len(self.passages) > RECENT:  # the least recently returned go first
            del self.passages[next(iter(self.passages))]
        return results

    def visit(self, url, seed=None, level=None, max_chars=VISIT_CHARS, allowed=()):
        if url not in allowed:
            raise SearchError(NOT_AMONG.format(url[:200]))
        if url not in self.passages:
            raise SearchError(f"cannot visit {url[:200]!r}: not a passage this retriever returned lately")
        return clean_text(self.passages[url][:max_chars])


def _documents(text):
    """The documents of a /retrieve reply to one query, TOPK at most; SearchError if it is not of that shape."""
    try:
        result = json.loads(text)["result"]
        hits = result[0] if isinstance(result, list) and len(result) == 1 and isinstance(result[0], list) else None
        if hits is not None and len(hits) <= TOPK and all(
                isinstance(h, dict) and isinstance(d := h.get("document"), dict) and isinstance(d.get("contents"), str)
                and (type(d.get("id")) in (str, int) or d.get("id") is None)
                and type(h.get("score")) in (int, float) and math.isfinite(h["score"]) for h in hits):
            return [h["document"] for h in hits]
    except (ValueError, KeyError, TypeError, IndexError, RecursionError, OverflowError):
        pass
    raise SearchError(f"retriever sent no Search-R1-style results: {clean_text(text[:200])}")


def main(argv=None):
    ap = argparse.ArgumentParser(description="BM25 over a corpus of passages: build its index, or serve "
                                             "it with Search-R1's POST /retrieve.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("command", choices=["build", "serve"], help="build: the index alone (cached beside the "
                    "corpus); serve: build or load it, then answer requests, a log line each")
    ap.add_argument("corpus", help="a .jsonl file: one {id, title, contents} or {id, contents} a line")
    ap.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    ap.add_argument("--port", type=int, default=8000, help="the port to listen on (0: a free one)")
    args = ap.parse_args(argv)
    try:
        index = Bm25Search(args.corpus)
    except (OSError, ValueError, ImportError) as e:
        sys.exit(f"error: {e}")
    if args.command == "serve":
        srv = make_server(index, args.host, args.port)
        print(f"retriever on http://{args.host}:{srv.server_address[1]}/retrieve", flush=True)
        srv.serve_forever()


if __name__ == "__main__":
    main()
