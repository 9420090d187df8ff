"""Browsing corpus: one seed -> pages about invented people, companies, cities and countries, and multi-hop
questions with gold answers and evidence-page sets.

Facts (one sentence each, on the page of the entity they start from):
    person  --founded-->  company  "{p} founded {c}."
    person  --born_in-->  city     "{p} was born in {x}."
    company --hq------->  city     "{c} is headquartered in {x}."
    company --ceo------>  person   "{c}'s chief executive is {p}."
    city    --mayor---->  person   "The mayor of {x} is {p}."
    city    --country-->  country  "{x} lies in {k}."
A question walks `hops` (1-4) relations from a start entity and nests their phrases ("Name the mayor of the city
where the company founded by Ada Brandt is headquartered."); the gold answer is the last entity's name, the
`answer_fact` is the sentence that states it, and the evidence set is the pages of the entities the walk leaves
from (each holds one needed fact). Names are invented
(no world knowledge helps) and unique; filler lines name no entity, so only fact lines carry answers.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from mercury_jax.envs.enterprise.world import COMPANY_WORDS, FIRST, LAST, SUFFIXES

SYLLABLES = ["var", "hol", "ten", "mar", "qui", "sel", "dor", "ani", "bre", "lok", "sun", "tir", "ove", "pal",
             "gre", "nor", "vik", "ast", "eld", "ron"]
FILLER = ["It is often mentioned in regional guides.", "Its archive was digitised in recent years.",
          "Local newspapers covered it several times.", "Historians disagree about some early records.",
          "Visitors describe it as quiet and orderly.", "A short documentary once featured it.",
          "Its records are kept in the national library.", "Several awards were associated with it."]
RELATIONS = {  # relation: (source kind, target kind, fact sentence, question phrase wrapping the source phrase)
    "founded": ("person", "company", "{s} founded {t}.", "the company founded by {s}"),
    "born_in": ("person", "city", "{s} was born in {t}.", "the city where {s} was born"),
    "hq": ("company", "city", "{s} is headquartered in {t}.", "the city where {s} is headquartered"),
    "ceo": ("company", "person", "{s}'s chief executive is {t}.", "the chief executive of {s}"),
    "mayor": ("city", "person", "The mayor of {s} is {t}.", "the mayor of {s}"),
    "country": ("city", "country", "{s} lies in {t}.", "the country that {s} lies in"),
}
SHORT_NAMES = {  # short_names pools: one capitalised plain word each, disjoint across kinds
    "person": ("Ada", "Bruno", "Elena", "Hugo", "Ines", "Lars", "Mei", "Nadia", "Omar", "Rosa", "Sven", "Uma"),
    "company": ("Aster", "Birch", "Cobalt", "Delta", "Ember", "Lumen", "Raven", "Summit"),
    "city": ("Elm", "Fern", "Moss", "Pine", "Reed", "Sage"),
    "country": ("Amber", "Coral", "Ivory", "Jade"),
}
KIND_LINE = {"person": "{n} is a person.", "company": "{n} is a company.", "city": "{n} is a city.",
             "country": "{n} is a country."}


@dataclass(frozen=True)
class CorpusConfig:
    people: int = 24
    companies: int = 10
    cities: int = 8
    countries: int = 4
    filler_lines: tuple[int, int] = (3, 6)
    hops: tuple[int, int] = (1, 4)
    short_names: bool = False     # one-word names from SHORT_NAMES (tiny preset); False = invented multi-piece names


def generate_corpus(seed: int, config: CorpusConfig = CorpusConfig()) -> dict:
    """{"pages": [{id, title, url, kind, lines}], "facts": {(source, relation): target} as a list}."""
    rng = random.Random(f"browse-corpus-{seed}")
    if config.short_names:
        sizes = {"person": config.people, "company": config.companies, "city": config.cities,
                 "country": config.countries}
        for kind, size in sizes.items():
            if size > len(SHORT_NAMES[kind]):
                raise ValueError(f"short_names has {len(SHORT_NAMES[kind])} {kind} names; {size} requested")
        entities = {kind: rng.sample(SHORT_NAMES[kind], size) for kind, size in sizes.items()}
    else:
        entities = _invented_names(rng, config)
    people = list(entities["person"])
    rng.shuffle(people)
    facts: dict[tuple[str, str], str] = {}
    for company, founder in zip(entities["company"], people):
        facts[(founder, "founded")] = company
    rest = people[len(entities["company"]):] or people
    for i, company in enumerate(entities["company"]):
        facts[(company, "hq")] = rng.choice(entities["city"])
        facts[(company, "ceo")] = rest[i % len(rest)]
    for i, city in enumerate(entities["city"]):
        facts[(city, "country")] = rng.choice(entities["country"])
        facts[(city, "mayor")] = rest[(i + len(entities["company"])) % len(rest)]
    for person in entities["person"]:
        facts[(person, "born_in")] = rng.choice(entities["city"])
    pages = []
    for kind in ("person", "company", "city", "country"):
        for name in entities[kind]:
            lines = [KIND_LINE[kind].format(n=name)]
            body = [RELATIONS[r][2].format(s=name, t=t) for (s, r), t in facts.items() if s == name]
            body += rng.sample(FILLER, rng.randint(*config.filler_lines))
            rng.shuffle(body)
            pages.append({"title": name, "kind": kind, "lines": lines + body})
    rng.shuffle(pages)
    for i, page in enumerate(pages):
        page["id"] = f"p{i:03d}"
        page["url"] = "https://wiki.local/" + page["title"].replace(" ", "_")
    return {"seed": seed, "pages": pages, "facts": [[s, r, t] for (s, r), t in facts.items()]}


def _invented_names(rng: random.Random, config: CorpusConfig) -> dict[str, list[str]]:
    names: set[str] = set()

    def unique(make) -> str:
        while True:
            name = make()
            if name not in names:
                names.add(name)
                return name

    def place() -> str:
        return "".join(rng.sample(SYLLABLES, rng.randint(2, 3))).capitalize()

    return {"person": [unique(lambda: f"{rng.choice(FIRST)} {rng.choice(LAST)}") for _ in range(config.people)],
            "company": [unique(lambda: f"{rng.choice(COMPANY_WORDS)} {rng.choice(SUFFIXES)}")
                        for _ in range(config.companies)],
            "city": [unique(place) for _ in range(config.cities)],
            "country": [unique(lambda: place() + rng.choice(["ia", "land", "stan"]))
                        for _ in range(config.countries)]}


def generate_questions(corpus: dict, count: int, config: CorpusConfig = CorpusConfig(), *,
                       seed: int = 0) -> list[dict]:
    """`count` distinct questions: {question, answer, answer_fact, evidence (page ids), hops, chain}."""
    rng = random.Random(f"browse-questions-{corpus['seed']}-{seed}")
    facts = {(s, r): t for s, r, t in corpus["facts"]}
    by_title = {p["title"]: p for p in corpus["pages"]}
    out, seen = [], set()
    for _ in range(50 * count):
        if len(out) == count:
            break
        hops = rng.randint(*config.hops)
        start = rng.choice(corpus["pages"])["title"]
        chain, node = [start], start
        for _ in range(hops):
            options = sorted(r for (s, r) in facts if s == node)
            if not options:
                break
            relation = rng.choice(options)
            node = facts[(node, relation)]
            chain += [relation, node]
        relations = chain[1::2]
        if len(relations) != hops or node in chain[:-1:2] or node in seen or (start, tuple(relations)) in seen:
            continue  # the walk came back to an entity it saw (the answer would be in the question) or repeats
        phrase = start
        for relation in relations:
            phrase = RELATIONS[relation][3].format(s=phrase)
        seen.update([node, (start, tuple(relations))])
        fact = RELATIONS[relations[-1]][2].format(s=chain[-3], t=node)
        out.append({"question": f"Name {phrase}.", "answer": node, "answer_fact": fact, "hops": hops, "chain": chain,
                    "evidence": [by_title[e]["id"] for e in chain[:-1:2]]})
    return out
