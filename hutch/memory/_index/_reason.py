"""An optional reasoning provider: an LLM that rewrites a question into searches and re-ranks the top hits.

Off by default (`Memory(path, reasoner=None)`). With `Memory(path, reasoner=OpenAIReasoner(base_url, model))`
(any OpenAI-compatible `POST {base_url}/chat/completions`; `OpenAIReasoner.from_settings()` reads
$HUTCH_REASONER_URL and the rest) a search asks it twice: first for up to MAX_QUERIES shorter searches that
together answer the question ("What activities has Melanie done with her family?" -> "Melanie camping with
family", "Melanie kids pottery" ...), each run through the whole pipeline and merged with the question's own
list by reciprocal rank; then for the order of the RERANK best candidates' texts (TEXT_CHARS each). Any object
with `rewrite(question) -> list[str]` and `rerank(question, texts) -> list[int]` (indices, best first) will do;
what it gets and what it answers are bounded and checked here (`queries`, `passages`, `reorder`), whatever it is.

It can only re-order what search found and add searches: it never names a hit itself. It degrades, never
breaks: an endpoint that is down, slow (a whole request past `timeout` seconds), answers too much
(MAX_RESPONSE_BYTES, MAX_ANSWER_CHARS) or answers garbage (not JSON, deep nesting, wrong types, indices out of
range) is a ReasonerError; the search then answers as without a reasoner, warns once (a ReasonerWarning) and
does not ask it again for `cooldown` seconds (SearchIndex._reasoned).
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any, Sequence

from hutch._core import settings
from hutch._core.errors import ConfigError, SearchIndexError

#: At most this many rewritten searches per question (each costs a whole search).
MAX_QUERIES = 3
#: Characters of one rewritten search kept.
QUERY_CHARS = 200
#: The best candidates whose texts the reasoner re-orders.
RERANK = 30
#: Characters of a candidate's text shown to the reasoner (with its speaker and date in front).
TEXT_CHARS = 400
#: Characters of the question sent (search itself takes at most 4,096).
QUESTION_CHARS = 1000
#: Bytes of an HTTP answer read; past it the answer is refused.
MAX_RESPONSE_BYTES = 64 * 1024
#: Characters of the model's message (the JSON list) accepted.
MAX_ANSWER_CHARS = 8 * 1024
#: Tokens the model is asked to answer with at most (`max_tokens`).
MAX_TOKENS = 400
#: Default seconds one request may take in all (connect, send, the whole answer).
TIMEOUT = 15.0
#: Default seconds the reasoner is not asked again after it failed (each failed search would otherwise wait
#: for the timeout again).
COOLDOWN = 60.0

_REWRITE = ("You turn a question about a person's memories into at most {n} short search queries (keywords, names, "
            "things, places) that together find what answers it. Answer with a JSON list of strings only.")
_RERANK = ("You are given a question and numbered passages. Order the passages by how well they help answer the "
           "question, best first. Answer with a JSON list of passage numbers only.")
_INDEX = re.compile(r"[0-9]{1,4}")


class ReasonerError(SearchIndexError):
    """The reasoner failed or answered something unusable (search then answers without it)."""


def _key_from(path: str | os.PathLike, what: str) -> str:
    from hutch._core.tokens import read_token_file

    return read_token_file(path, what, min_chars=1)


class OpenAIReasoner:
    """A chat model behind an OpenAI-compatible endpoint (`POST {base_url}/chat/completions`).

    The API key: `api_key`, else the file `api_key_file` (mode 0600), else the file $HUTCH_REASONER_KEY_FILE,
    else $OPENAI_API_KEY, else none (a local server). `timeout` bounds each request as a whole; after a failure
    search leaves the reasoner out for `cooldown` seconds."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None,
                 api_key_file: str | os.PathLike | None = None, timeout: float = TIMEOUT,
                 cooldown: float = COOLDOWN):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base_url {base_url!r} must start with http:// or https://, e.g. "
                              "'http://127.0.0.1:8000/v1'.")
        if not model or not isinstance(model, str):
            raise ConfigError("OpenAIReasoner needs a model name, e.g. model='gpt-4o-mini'.")
        if not (isinstance(timeout, (int, float)) and 0 < timeout <= 600):
            raise ConfigError(f"timeout={timeout!r} must be a number of seconds in (0, 600].")
        if not (isinstance(cooldown, (int, float)) and cooldown >= 0):
            raise ConfigError(f"cooldown={cooldown!r} must be a number of seconds, 0 or more.")
        self.base_url = base_url.rstrip("/")
        self.model = model
        if api_key is None and api_key_file is not None:
            api_key = _key_from(api_key_file, "api_key_file")
        if api_key is None and settings.REASONER_KEY_FILE.get() is not None:
            api_key = _key_from(settings.REASONER_KEY_FILE.get(), f"${settings.REASONER_KEY_FILE.name}")
        self._api_key = api_key if api_key is not None else settings.OPENAI_API_KEY.get()
        self.timeout = float(timeout)
        self.cooldown = float(cooldown)

    @classmethod
    def from_settings(cls, **kw: Any) -> "OpenAIReasoner":
        """The reasoner the environment names: $HUTCH_REASONER_URL, $HUTCH_REASONER_MODEL, $HUTCH_REASONER_TIMEOUT
        and the key as in the constructor; `kw` wins over them."""
        url = kw.pop("base_url", None) or settings.REASONER_URL.get()
        if url is None:
            raise ConfigError(f"No reasoner is configured: set ${settings.REASONER_URL.name} to an OpenAI-compatible "
                              "endpoint, e.g. http://127.0.0.1:8000/v1 (docs/retrieval.md, 'An optional reasoning "
                              "provider').")
        kw.setdefault("timeout", settings.REASONER_TIMEOUT.get())
        return cls(url, kw.pop("model", None) or settings.REASONER_MODEL.get(), **kw)

    def __repr__(self) -> str:
        return f"OpenAIReasoner({self.base_url!r}, {self.model!r})"

    def _fail(self, why: str) -> ReasonerError:
        return ReasonerError(f"the reasoning endpoint {self.base_url}/chat/completions (model {self.model!r}) {why}")

    def _post(self, body: bytes) -> bytes:
        """The answer's bytes, read within `timeout` seconds in all and at most MAX_RESPONSE_BYTES."""
        import httpx

        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        deadline = time.monotonic() + self.timeout
        try:
            with httpx.Client(timeout=self.timeout, follow_redirects=False) as client:
                with client.stream("POST", f"{self.base_url}/chat/completions", content=body,
                                   headers=headers) as r:
                    if r.status_code != 200:
                        raise self._fail(f"answered HTTP {r.status_code}: check the URL, the model name and the "
                                         "API key.")
                    got = bytearray()
                    for chunk in r.iter_bytes():
                        got += chunk
                        if len(got) > MAX_RESPONSE_BYTES:
                            raise self._fail(f"answered more than {MAX_RESPONSE_BYTES // 1024} KiB; refused.")
                        if time.monotonic() > deadline:
                            raise self._fail(f"took longer than {self.timeout:g} s to answer.")
                    return bytes(got)
        except httpx.TimeoutException:
            raise self._fail(f"took longer than {self.timeout:g} s to answer.") from None
        except httpx.HTTPError as e:
            raise self._fail(f"could not be reached ({type(e).__name__}: {str(e)[:200]}): is it running?") from None

    def _ask(self, system: str, user: str) -> list:
        body = json.dumps({"model": self.model, "temperature": 0, "max_tokens": MAX_TOKENS,
                           "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]},
                          ensure_ascii=True).encode()
        raw = self._post(body)
        try:
            text = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, RecursionError, KeyError, IndexError, TypeError):
            raise self._fail("did not answer as an OpenAI-compatible chat endpoint does "
                             f"({raw[:80]!r}).") from None
        if not isinstance(text, str):
            raise self._fail(f"answered a message that is not text ({type(text).__name__}).")
        if len(text) > MAX_ANSWER_CHARS:
            raise self._fail(f"answered {len(text):,} characters, more than {MAX_ANSWER_CHARS:,}; refused.")
        got = first_list(text)
        if got is None:
            raise self._fail(f"did not answer with a JSON list ({text[:80]!r}).")
        return got

    def rewrite(self, question: str) -> list[str]:
        return self._ask(_REWRITE.format(n=MAX_QUERIES), question[:QUESTION_CHARS])

    def rerank(self, question: str, texts: Sequence[str]) -> list[int]:
        numbered = "\n".join(f"[{i}] {t}" for i, t in enumerate(texts))
        return self._ask(_RERANK, f"Question: {question[:QUESTION_CHARS]}\n\nPassages:\n{numbered}")


def first_list(text: str) -> list | None:
    """The first JSON list in a model's message (it may wrap it in prose or a code fence), or None."""
    decoder = json.JSONDecoder()
    at = text.find("[")
    for _ in range(16):
        if at < 0:
            return None
        try:
            got, _ = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            got = None
        if isinstance(got, list):
            return got
        at = text.find("[", at + 1)
    return None


def queries(got: Any, question: str) -> list[str]:
    """The usable searches of a rewrite answer: strings, white space collapsed, at most QUERY_CHARS each, none
    the question itself or twice, at most MAX_QUERIES. An answer that is not a list is a ReasonerError."""
    if not isinstance(got, (list, tuple)):
        raise ReasonerError(f"the reasoner's rewrite answered {type(got).__name__}, not a list of searches.")
    seen = {" ".join(question.split()).lower()}
    out: list[str] = []
    for q in got[:64]:
        if not isinstance(q, str):
            continue
        q = " ".join(q.split())[:QUERY_CHARS].strip()
        if q and q.lower() not in seen:
            seen.add(q.lower())
            out.append(q)
        if len(out) == MAX_QUERIES:
            break
    return out


def passage(text: str, speaker: str | None = None, when: str | None = None) -> str:
    """What the reasoner is shown of one candidate: its date and speaker, then at most TEXT_CHARS of its text,
    on one line."""
    text = " ".join(text.split())
    head = "".join(f"{x} " for x in (f"({when[:10]})" if when else None, f"{speaker}:" if speaker else None) if x)
    return head + text[:TEXT_CHARS]


def reorder(n: int, order: Any) -> list[int]:
    """The reasoner's order of n candidates: the indices it named (each once, in range), then the rest. An
    answer that is not a list, or names none of them, is a ReasonerError."""
    if not isinstance(order, (list, tuple)):
        raise ReasonerError(f"the reasoner's re-rank answered {type(order).__name__}, not a list of passage numbers.")
    seen: dict[int, None] = {}
    for i in order[:4 * n + 16]:
        if isinstance(i, str) and _INDEX.fullmatch(i.strip()):
            i = int(i)
        if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n:
            seen.setdefault(i, None)
    if n and not seen:
        raise ReasonerError(f"the reasoner's re-rank named none of the {n} passages (it answered {len(order)} "
                            "items).")
    return list(seen) + [i for i in range(n) if i not in seen]


def merge(lists: Sequence[Sequence[tuple[str, str | None]]], k: int = 60) -> list[tuple[str, str | None]]:
    """Hit keys (entity, anchor) of several searches, merged by reciprocal rank (the question's own first)."""
    score: dict[tuple[str, str | None], float] = {}
    for hits in lists:
        for r, key in enumerate(hits, 1):
            score[key] = score.get(key, 0.0) + 1.0 / (k + r)
    return sorted(score, key=lambda key: -score[key])
