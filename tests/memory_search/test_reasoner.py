"""The optional reasoning provider (issue 16): `Memory(path, reasoner=OpenAIReasoner(...))` rewrites a question
into searches and re-ranks the top hits through an OpenAI-compatible chat endpoint, and degrades, never breaks.

The endpoint is FakeChatServer, a fake (a real HTTP server on loopback that plays the LLM with fixed rules: it
is not a model): the external API is the only thing faked; store, index, search and the CLI are real."""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import warnings
from http.server import BaseHTTPRequestHandler

import pytest
from hutch_testing import LoopbackHTTP

import hutch
from hutch.memory._index import _reason

QUESTION = "What animal does Sam keep in the backyard?"


class FakeChatServer(LoopbackHTTP):
    """A fake OpenAI-compatible /chat/completions on 127.0.0.1. In `mode` "ok" it answers a rewrite request with
    `queries`, a re-rank request with the passages that contain `prefer` first, the rest in reverse order. Other
    modes are the failures: "500", "not-json", "deep" (a re-rank answer nested past any parser's depth), "not-text" (a
    message that is an object), "bools" (a re-rank of booleans, floats and numbers out of range), "huge" (a
    1 MiB answer), "slow" (no answer until the test ends), "drip" (a byte every 50 ms, forever)."""

    def __init__(self, queries=("terrapin water lilies",), prefer="terrapin"):
        self.queries, self.prefer = list(queries), prefer
        self.mode = "ok"
        self.requests: list[dict] = []
        self.stop = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                body = json.loads(raw)
                fake.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "bytes": len(raw),
                                      **body})
                mode = fake.mode
                if mode == "500" or self.path != "/v1/chat/completions":
                    return self._send(500, b"{}")
                if mode == "slow":
                    fake.stop.wait(120)
                    return
                if mode == "drip":
                    self.send_response(200)
                    self.send_header("Content-Length", "100000")
                    self.end_headers()
                    while not fake.stop.wait(0.05):
                        try:
                            self.wfile.write(b" ")
                            self.wfile.flush()
                        except OSError:
                            return
                    return
                if mode == "not-json":
                    return self._send(200, b"<html>Bad gateway</html>")
                if mode == "huge":
                    return self._send(200, b'{"choices": [{"message": {"content": "[' + b"1, " * 350_000 + b'1]"}}]}')
                system, user = body["messages"][0]["content"], body["messages"][1]["content"]
                rewrite = "search queries" in system
                if mode == "deep" and not rewrite:
                    return self._send(200, b"[" * 60_000)
                if mode == "not-text":
                    return self._answer({"list": [0, 1]})
                if rewrite:
                    return self._answer(json.dumps(fake.queries))
                passages = re.findall(r"^\[(\d+)\] (.*)$", user, re.M)
                if mode == "bools":
                    return self._answer(f"[true, false, 1e999, -1, {len(passages)}, 99999999999999999999, \"x\"]")
                first = [int(i) for i, t in passages if fake.prefer in t]
                return self._answer("Here you are:\n```json\n" + json.dumps(
                    first + [int(i) for i, _ in reversed(passages) if int(i) not in first]) + "\n```")

            def _answer(self, content):
                self._send(200, json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]})
                           .encode())

            def _send(self, status, out):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                try:
                    self.wfile.write(out)
                except OSError:  # the client stopped reading (the "huge" answer): as it should
                    pass

        super().__init__(Handler)

    @property
    def url(self):
        return f"{self.origin}/v1"

    def __exit__(self, *exc):
        self.stop.set()   # the "slow" and "drip" answers end
        super().__exit__(*exc)


def _store(path, body_words=""):
    mem = hutch.Memory(path)
    with mem.transaction():
        for i in range(35):
            mem.put("notes", f"Chores {i}", body=f"Sam mowed the lawn and fixed the fence, week {i}. {body_words}")
        mem.put("notes", "Pond", body="A terrapin sunbathes on a rock by the water lilies.")
    return mem


@pytest.fixture
def plain(store_dir):
    """The store, and the hits of QUESTION without a reasoner (which do not reach the pond)."""
    mem = _store(store_dir)
    before = [h.entity_id for h in mem.search(QUESTION, k=5)]
    assert "notes/pond" not in before
    mem.index.close()
    return before


@pytest.fixture
def fake():
    with FakeChatServer() as f:
        yield f


def _searched(mem, q=QUESTION, k=5):
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        hits = mem.search(q, k=k)
    return hits, [w for w in said if issubclass(w.category, hutch.ReasonerWarning)]


def _reasoned(store_dir, fake, **kw):
    kw.setdefault("api_key", "k")
    return hutch.Memory(store_dir, reasoner=hutch.OpenAIReasoner(fake.url, "fake-model", **kw))


def test_the_reasoner_rewrites_and_reranks_through_a_fake_endpoint(store_dir, plain, fake):
    mem = _reasoned(store_dir, fake)
    try:
        hits, said = _searched(mem)
        assert said == [] and mem.doctor().reasoner_error is None
        assert hits[0].entity_id == "notes/pond" and hits[0].channels["reasoner"]["rank"] == 1
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
        assert len(fake.requests) == 2 and {r["model"] for r in fake.requests} == {"fake-model"}
        assert all(r["auth"] == "Bearer k" and r["path"] == "/v1/chat/completions" for r in fake.requests)
        assert all(r["max_tokens"] == _reason.MAX_TOKENS for r in fake.requests)
        assert fake.requests[0]["messages"][1]["content"] == QUESTION
        rerank = fake.requests[1]["messages"][1]["content"]
        assert rerank.startswith(f"Question: {QUESTION}") and rerank.count("\n[") == _reason.RERANK
        assert "(notes/" not in rerank and str(store_dir) not in rerank  # texts only: no ids, no paths
    finally:
        mem.index.close()


def test_what_is_sent_is_bounded(store_dir, fake):
    mem = _store(store_dir, body_words="lawn " * 20_000)  # 100 KB per entity
    mem.index.close()
    mem = _reasoned(store_dir, fake)
    try:
        long_question = "What animal does Sam keep by the lawn? " * 100  # 3,900 characters
        hits, said = _searched(mem, long_question)
        assert said == [] and len(fake.requests) == 2
        rewrite, rerank = (r["messages"][1]["content"] for r in fake.requests)
        assert rewrite == long_question[:_reason.QUESTION_CHARS]
        passages = re.findall(r"^\[\d+\] (.*)$", rerank, re.M)
        assert len(passages) == _reason.RERANK
        assert all(len(p) <= _reason.TEXT_CHARS + 40 for p in passages)
        bound = _reason.QUESTION_CHARS + _reason.RERANK * (_reason.TEXT_CHARS + 60) + 1000
        assert all(r["bytes"] <= bound for r in fake.requests), [r["bytes"] for r in fake.requests]
    finally:
        mem.index.close()


@pytest.mark.parametrize("mode", ["500", "not-json", "deep", "not-text", "bools", "huge", "slow", "drip", "down"])
def test_a_failing_endpoint_gives_the_plain_hits_and_one_warning(store_dir, plain, fake, mode):
    if mode == "down":  # a port nothing listens on
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        reasoner = hutch.OpenAIReasoner(f"http://127.0.0.1:{port}/v1", "m", api_key="k", timeout=2, cooldown=0)
        mem = hutch.Memory(store_dir, reasoner=reasoner)
    else:
        fake.mode = mode
        mem = _reasoned(store_dir, fake, timeout=1.5, cooldown=0)
    try:
        hits, said = _searched(mem)
        assert [h.entity_id for h in hits] == plain and all("reasoner" not in h.channels for h in hits)
        assert len(said) == 1, [str(w.message) for w in said]
        msg = str(said[0].message)
        assert msg.startswith("search answered without its reasoner OpenAIReasoner('http://127.0.0.1:")
        assert mem.index.reasoner_error and mem.index.reasoner_error in msg
        report = mem.doctor()
        assert any(line.startswith("reasoner failed") for line in report.lines())
        # failing again in the same outage: the plain hits again, no second warning
        hits, said = _searched(mem)
        assert [h.entity_id for h in hits] == plain and said == []
    finally:
        mem.index.close()


def test_one_warning_per_outage_and_a_cooldown(store_dir, plain, fake):
    mem = _reasoned(store_dir, fake, cooldown=0)
    try:
        assert _searched(mem)[0][0].entity_id == "notes/pond"
        fake.mode = "500"
        assert len(_searched(mem)[1]) == 1
        fake.mode = "ok"  # back: reasoned again, the error cleared
        hits, said = _searched(mem)
        assert hits[0].entity_id == "notes/pond" and said == [] and mem.index.reasoner_error is None
        fake.mode = "500"  # a new outage: a new warning
        assert len(_searched(mem)[1]) == 1
    finally:
        mem.index.close()
    mem = _reasoned(store_dir, fake, cooldown=3600)
    try:
        hits, said = _searched(mem)
        assert len(said) == 1
        n = len(fake.requests)
        fake.mode = "ok"
        hits, said = _searched(mem)  # within the cooldown: not asked, plain hits, nothing more said
        assert [h.entity_id for h in hits] == plain and said == [] and len(fake.requests) == n
    finally:
        mem.index.close()


class _Broken:
    """A reasoner object of the caller's own whose rerank raises."""

    def rewrite(self, question):
        return ["terrapin", 7, None]

    def rerank(self, question, texts):
        raise RuntimeError("my model crashed")


def test_any_reasoner_object_is_held_to_the_same_bounds(store_dir, plain):
    mem = hutch.Memory(store_dir, reasoner=_Broken())
    try:
        hits, said = _searched(mem)
        assert [h.entity_id for h in hits] == plain and len(said) == 1
        assert "raised RuntimeError: my model crashed" in str(said[0].message)
    finally:
        mem.index.close()
    # the pure checks: what a rewrite and a re-rank answer may hold
    assert _reason.queries(["  a  b ", "A B", QUESTION, 3, "x" * 500, "c", "d"], QUESTION) == ["a b", "x" * 200, "c"]
    with pytest.raises(_reason.ReasonerError):
        _reason.queries({"q": 1}, QUESTION)
    assert _reason.reorder(4, [2, 2, 9, "0", True, -1, 1.0]) == [2, 0, 1, 3]  # each once, in range, the rest after
    with pytest.raises(_reason.ReasonerError, match="named none"):
        _reason.reorder(3, [True, "x", 7])
    with pytest.raises(_reason.ReasonerError):
        _reason.reorder(3, "0 1 2")
    assert _reason.first_list('Sure: ```json\n[1, 2]\n``` and [3]') == [1, 2]
    assert _reason.first_list("[[[[" * 2000) is None and _reason.first_list("no list") is None


def test_no_reasoner_by_default_bad_arguments_and_the_key(store_dir, monkeypatch, tmp_path):
    mem = hutch.Memory(store_dir)
    assert mem.reasoner is None and mem.index.reasoner is None
    mem.index.close()
    with pytest.raises(hutch.ConfigError, match="http://"):
        hutch.OpenAIReasoner("localhost:8000", "m")
    with pytest.raises(hutch.ConfigError, match="timeout"):
        hutch.OpenAIReasoner("http://127.0.0.1:1/v1", "m", timeout=0)
    monkeypatch.delenv("HUTCH_REASONER_URL", raising=False)
    with pytest.raises(hutch.ConfigError, match="HUTCH_REASONER_URL"):
        hutch.OpenAIReasoner.from_settings()
    # the key: the argument, else a file (mode 0600), else $HUTCH_REASONER_KEY_FILE, else $OPENAI_API_KEY
    monkeypatch.setenv("OPENAI_API_KEY", "from-env")
    monkeypatch.delenv("HUTCH_REASONER_KEY_FILE", raising=False)
    key = tmp_path / "key"
    key.write_text("from-file\n")
    key.chmod(0o644)
    with pytest.raises(hutch.ConfigError, match="chmod 600"):
        hutch.OpenAIReasoner("http://127.0.0.1:1/v1", "m", api_key_file=key)
    key.chmod(0o600)
    assert hutch.OpenAIReasoner("http://127.0.0.1:1/v1", "m", api_key_file=key)._api_key == "from-file"
    assert hutch.OpenAIReasoner("http://127.0.0.1:1/v1", "m")._api_key == "from-env"
    monkeypatch.setenv("HUTCH_REASONER_KEY_FILE", str(key))
    monkeypatch.setenv("HUTCH_REASONER_URL", "http://127.0.0.1:1/v1")
    monkeypatch.setenv("HUTCH_REASONER_MODEL", "local-model")
    monkeypatch.setenv("HUTCH_REASONER_TIMEOUT", "2.5")
    r = hutch.OpenAIReasoner.from_settings()
    assert (r.base_url, r.model, r.timeout, r._api_key) == ("http://127.0.0.1:1/v1", "local-model", 2.5, "from-file")
    assert "from-file" not in repr(r)


def test_the_cli_reasoner_flag(store_dir, plain, fake, tmp_path):
    key = tmp_path / "key"
    key.write_text("cli-key")
    key.chmod(0o600)
    env = {**os.environ, "HUTCH_REASONER_URL": fake.url, "HUTCH_REASONER_MODEL": "fake-model",
           "HUTCH_REASONER_KEY_FILE": str(key), "HUTCH_REASONER_TIMEOUT": "5"}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "hutch", "mem", "--store", str(store_dir), "search", QUESTION,
                               "-k", "3", *args], capture_output=True, text=True, timeout=300, env=env)

    r = cli("--json", "--reasoner")
    assert r.returncode == 0, r.stderr
    hits = json.loads(r.stdout)
    assert hits[0]["id"] == "notes/pond" and hits[0]["channels"]["reasoner"]["rank"] == 1
    assert fake.requests[-1]["auth"] == "Bearer cli-key" and "cli-key" not in " ".join(r.args)
    n = len(fake.requests)
    r = cli("--json")  # without the flag the endpoint is not asked
    assert r.returncode == 0 and len(fake.requests) == n and "reasoner" not in r.stdout
    fake.mode = "500"
    r = cli("--reasoner")
    assert r.returncode == 0, r.stderr
    assert [line.split()[2] for line in r.stdout.splitlines()] == plain[:3]
    assert r.stderr.count("hutch: warning: search answered without its reasoner ") == 1 and "HTTP 500" in r.stderr
    assert "Traceback" not in r.stderr
    env.pop("HUTCH_REASONER_URL")
    r = cli("--reasoner")
    assert r.returncode == 1 and "HUTCH_REASONER_URL" in r.stdout + r.stderr
