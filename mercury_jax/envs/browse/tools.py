"""The browsing surface over one corpus: `search(query, topn)` (BM25 via `bm25s`), `open(id, loc, num_lines)`
with numbered lines, `find(pattern)` inside the open page. Outputs are deterministic text.

Observation formats (sufficiency and the stop-verifier read them back):
    search -> "[0] Title (id: p012)\\n[1] ..."            titles only, no page text
    open   -> "[page p012] Title <url>\\nL0: ...\\nL1: ..."  lines loc .. loc+num_lines-1
    find   -> "[page p012] Title\\nL3: ..."                lines of the open page containing pattern
"""
from __future__ import annotations

import inspect
import logging
import re

from mercury_jax.envs.enterprise.toolkit import ToolError

PAGE_HEADER = re.compile(r"^\[page (p\d+)\]")


class BrowseIndex:
    """A BM25 index over a corpus's pages (title weighted twice), built once per episode."""
    def __init__(self, corpus: dict):
        # importing bm25s runs a jax function, which starts JAX's backend: imported here, so that importing this
        # module (every entry point does) leaves `jax.distributed.initialize` possible until `main()` calls it
        import bm25s  # noqa: PLC0415

        logging.getLogger("bm25s").setLevel(logging.WARNING)
        self.pages = corpus["pages"]
        self.by_id = {p["id"]: p for p in self.pages}
        self.by_url = {p["url"]: p for p in self.pages}
        texts = [f"{p['title']} {p['title']} " + " ".join(p["lines"]) for p in self.pages]
        self._tokenize = lambda t: bm25s.tokenize(t, stopwords="en", return_ids=False, show_progress=False)
        self.retriever = bm25s.BM25(backend="numpy") if _accepts_backend(bm25s) else bm25s.BM25()
        self.retriever.index(self._tokenize(texts), show_progress=False)
        self.vocab = set(self.retriever.vocab_dict)

    def search(self, query: str, topn: int) -> list[dict]:
        tokens = [t for t in self._tokenize([query])[0] if t in self.vocab]
        if not tokens:
            return []
        k = min(topn, len(self.pages))
        docs, scores = self.retriever.retrieve([tokens], k=k, show_progress=False, n_threads=1)
        ranked = sorted(zip(docs[0].tolist(), scores[0].tolist()), key=lambda x: (-round(x[1], 6), x[0]))
        return [self.pages[i] for i, s in ranked if s > 0]


def browse_tools(index: BrowseIndex, log: list | None = None) -> dict:
    """`search`, `open`, `find` closures over one index; `log` (if given) records each call's page ids."""
    state = {"open": None}

    async def search(query: str, topn: int = 5) -> str:
        """Search the pages (BM25); returns ranked titles with page ids."""
        if not 1 <= topn <= 20:
            raise ToolError(f"topn must be between 1 and 20, got {topn}")
        hits = index.search(query, topn)
        if log is not None:
            log.append(("search", query))
        if not hits:
            return f"No results for {query!r}."
        return "\n".join(f"[{i}] {p['title']} (id: {p['id']})" for i, p in enumerate(hits))

    async def open(id: str, loc: int = 0, num_lines: int = 20) -> str:  # noqa: A001 (the tool's public name)
        """Open a page by id (like p012) or url; shows numbered lines from loc."""
        page = index.by_id.get(id.strip()) or index.by_url.get(id.strip())
        if page is None:
            raise ToolError(f"no page {id!r}; page ids look like p012, get them from search")
        if loc < 0 or num_lines < 1:
            raise ToolError("loc must be >= 0 and num_lines >= 1")
        state["open"] = page
        if log is not None:
            log.append(("open", page["id"]))
        shown = page["lines"][loc:loc + num_lines]
        body = "\n".join(f"L{loc + i}: {line}" for i, line in enumerate(shown)) or "(no lines there)"
        return f"[page {page['id']}] {page['title']} <{page['url']}>\n{body}"

    async def find(pattern: str) -> str:
        """Find lines containing pattern (case-insensitive) in the open page."""
        page = state["open"]
        if page is None:
            raise ToolError("no page is open; call open first")
        if log is not None:
            log.append(("find", page["id"]))
        hits = [f"L{i}: {line}" for i, line in enumerate(page["lines"]) if pattern.lower() in line.lower()]
        return f"[page {page['id']}] {page['title']}\n" + ("\n".join(hits) or f"no line contains {pattern!r}")

    return {"search": search, "open": open, "find": find}


def _accepts_backend(bm25s_module) -> bool:
    return "backend" in inspect.signature(bm25s_module.BM25.__init__).parameters
