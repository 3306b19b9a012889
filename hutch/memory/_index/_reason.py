"""An optional reasoning provider: an LLM that rewrites a question into searches and re-ranks the top hits.

Off by default (`Memory(path, reasoner=None)`). With `Memory(path, reasoner=OpenAIReasoner(base_url, model))`
(any OpenAI-compatible `POST {base_url}/chat/completions`) a search asks it twice: first for up to
MAX_QUERIES shorter searches that together answer the question ("What activities has Melanie done with her
family?" -> "Melanie camping with family", "Melanie kids pottery" ...), each run through the whole pipeline
and merged with the question's own list by reciprocal rank; then for the order of the RERANK best candidates'
texts. Any object with `rewrite(question) -> list[str]` and `rerank(question, texts) -> list[int]` (indices,
best first) will do. A failing endpoint never fails a search: it answers without the reasoner, and
`SearchIndex.reasoner_error` (and `doctor()`) says why.
"""

from __future__ import annotations

import json
import re
from typing import Sequence

from hutch._core import settings
from hutch._core.errors import ConfigError, SearchIndexError

#: At most this many rewritten searches per question (each costs a whole search).
MAX_QUERIES = 3
#: The best candidates whose texts the reasoner re-orders.
RERANK = 20
#: Characters of a candidate's text shown to the reasoner.
TEXT_CHARS = 400

_REWRITE = ("You turn a question about a person's memories into at most {n} short search queries (keywords, names, "
            "things, places) that together find what answers it. Answer with a JSON list of strings only.")
_RERANK = ("You are given a question and numbered passages. Order the passages by how well they help answer the "
           "question, best first. Answer with a JSON list of passage numbers only.")


class OpenAIReasoner:
    """A chat model behind an OpenAI-compatible endpoint (`POST {base_url}/chat/completions`)."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, timeout: float = 30.0):
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base_url {base_url!r} must start with http:// or https://, e.g. "
                              "'http://127.0.0.1:8000/v1'.")
        if not model:
            raise ConfigError("OpenAIReasoner needs a model name, e.g. model='gpt-4o-mini'.")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key if api_key is not None else settings.OPENAI_API_KEY.get()
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"OpenAIReasoner({self.base_url!r}, {self.model!r})"

    def _ask(self, system: str, user: str) -> list:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = {"model": self.model, "temperature": 0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
        try:
            r = httpx.post(f"{self.base_url}/chat/completions", json=body, headers=headers, timeout=self.timeout)
            r.raise_for_status()
            text = r.json()["choices"][0]["message"]["content"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError, TypeError) as e:
            raise SearchIndexError(f"The reasoning endpoint {self.base_url} failed ({e}): check the URL, the model "
                                   f"name {self.model!r} and the API key, or search without a reasoner.") from e
        found = re.search(r"\[.*\]", text or "", re.S)
        try:
            got = json.loads(found.group(0)) if found else None
        except ValueError:
            got = None
        if not isinstance(got, list):
            raise SearchIndexError(f"The reasoning endpoint {self.base_url} did not answer with a JSON list "
                                   f"({(text or '')[:80]!r}).")
        return got

    def rewrite(self, question: str) -> list[str]:
        got = self._ask(_REWRITE.format(n=MAX_QUERIES), question)
        return [str(q) for q in got if isinstance(q, str) and q.strip()][:MAX_QUERIES]

    def rerank(self, question: str, texts: Sequence[str]) -> list[int]:
        numbered = "\n".join(f"[{i}] {' '.join(t.split())[:TEXT_CHARS]}" for i, t in enumerate(texts))
        got = self._ask(_RERANK, f"Question: {question}\n\nPassages:\n{numbered}")
        return [int(i) for i in got if isinstance(i, int) or (isinstance(i, str) and i.isdigit())]


def merge(lists: Sequence[Sequence[tuple[str, str | None]]], k: int = 60) -> list[tuple[str, str | None]]:
    """Hit keys (entity, anchor) of several searches, merged by reciprocal rank (the question's own first)."""
    score: dict[tuple[str, str | None], float] = {}
    for hits in lists:
        for r, key in enumerate(hits, 1):
            score[key] = score.get(key, 0.0) + 1.0 / (k + r)
    return sorted(score, key=lambda key: -score[key])


def reorder(n: int, order: Sequence[int]) -> list[int]:
    """The reasoner's order of n candidates: the indices it named (each once, in range), then the rest."""
    seen: dict[int, None] = {}
    for i in order:
        if 0 <= i < n:
            seen.setdefault(i, None)
    return list(seen) + [i for i in range(n) if i not in seen]
