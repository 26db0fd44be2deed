"""Benchmark (prints figures; not a test): the local retriever (retriever.py) on a synthetic corpus:
the index's build, its load from the cache, and a search's latency in-process and over HTTP.

    python -m benchmarks.bench_retriever                              # 100,000 passages, 200 queries
    python -m benchmarks.bench_retriever --passages 2000 --queries 20

The corpus is seeded: passages of 50 to 100 words drawn from a Zipf-like vocabulary of made-up words
(word i with weight 1/(i+1)), written to a temporary folder; a query is 2 to 4 words drawn the same
way. A search asks for retriever.TOPK passages, in-process (Bm25Search.search) or from the server on
127.0.0.1 through the client the runs use (RetrieveClient.search). The cache's load includes reading
and hashing the corpus. Figures are wall-clock on whatever machine runs it.
"""
import argparse
import itertools
import os
import random
import statistics
import tempfile
import threading
import time

import retriever

SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def vocabulary(rng, n):
    """n distinct made-up words of 2 to 4 syllables."""
    words = set()
    while len(words) < n:
        words.add("".join(rng.choices(SYLLABLES, k=rng.randint(2, 4))))
    return sorted(words)


def write_corpus(path, n, rng, words, cum):
    with open(path, "w") as f:
        for i in range(n):
            title = " ".join(rng.choices(words, cum_weights=cum, k=2))
            text = " ".join(rng.choices(words, cum_weights=cum, k=rng.randint(50, 100)))
            f.write(f'{{"id": "{i}", "title": "{title}", "contents": "{text}"}}\n')


def latencies(search, queries):
    out = []
    for q in queries:
        t0 = time.perf_counter()
        search(q)
        out.append(time.perf_counter() - t0)
    return out


def row(name, seconds):
    ms = sorted(s * 1000 for s in seconds)
    return f"{name:<12} median {statistics.median(ms):7.2f} ms   p90 {statistics.quantiles(ms, n=10)[-1]:7.2f} ms"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passages", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--vocabulary", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    words = vocabulary(rng, a.vocabulary)
    cum = list(itertools.accumulate(1 / (i + 1) for i in range(len(words))))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "corpus.jsonl")
        write_corpus(path, a.passages, rng, words, cum)
        print(f"corpus: {a.passages} passages of 50 to 100 words, {os.path.getsize(path) / 1e6:.1f} MB, "
              f"{a.vocabulary} words", flush=True)
        t0 = time.perf_counter()
        retriever.Bm25Search(path)
        build = time.perf_counter() - t0
        t0 = time.perf_counter()
        index = retriever.Bm25Search(path)
        load = time.perf_counter() - t0
        queries = [" ".join(rng.choices(words, cum_weights=cum, k=rng.randint(2, 4))) for _ in range(a.queries)]
        local = latencies(index.search, queries)
        srv = retriever.make_server(index)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        client = retriever.RetrieveClient(f"http://127.0.0.1:{srv.server_address[1]}/retrieve")
        http = latencies(client.search, queries)
        srv.shutdown()
    print(f"index build  {build:7.2f} s (reading, tokenizing, scoring, saving)")
    print(f"cache load   {load:7.2f} s (reading and hashing the corpus, loading the index)")
    print(f"search, top {retriever.TOPK}, {a.queries} queries:")
    print(row("in-process", local))
    print(row("over HTTP", http))


if __name__ == "__main__":
    main()
