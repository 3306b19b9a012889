"""The optional reasoning provider (issue 16): `Memory(path, reasoner=OpenAIReasoner(...))` rewrites a question
into searches and re-ranks the top hits through an OpenAI-compatible chat endpoint.

The endpoint is FakeChatServer, a fake (a real HTTP server on loopback that plays the LLM with fixed rules: it
is not a model): the external API is the only thing faked; store, index and search are real."""

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import hutch
from hutch.memory._index import _reason


class FakeChatServer:
    """A fake OpenAI-compatible /chat/completions on 127.0.0.1: to a rewrite request it answers `queries`; to a
    re-rank request the passages that contain `prefer` first, the rest in reverse order."""

    def __init__(self, queries, prefer):
        self.queries, self.prefer = queries, prefer
        self.requests: list[dict] = []
        self.fail = False
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
                if fake.fail or self.path != "/v1/chat/completions":
                    self.send_response(500)
                    self.end_headers()
                    return
                system, user = body["messages"][0]["content"], body["messages"][1]["content"]
                if "search queries" in system:
                    answer = json.dumps(fake.queries)
                else:
                    passages = re.findall(r"^\[(\d+)\] (.*)$", user, re.M)
                    first = [int(i) for i, t in passages if fake.prefer in t]
                    answer = "Here: " + json.dumps(first + [int(i) for i, _ in reversed(passages)
                                                            if int(i) not in first])
                out = json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


def _store(path):
    mem = hutch.Memory(path)
    with mem.transaction():
        for i in range(30):
            mem.put("notes", f"Chores {i}", body=f"Sam mowed the lawn and fixed the fence, week {i}.")
        mem.put("notes", "Pond", body="A terrapin sunbathes on a rock by the water lilies.")
    return mem


def test_the_reasoner_rewrites_and_reranks_through_a_fake_endpoint(store_dir):
    with FakeChatServer(queries=["terrapin water lilies"], prefer="terrapin") as fake:
        plain = _store(store_dir)
        question = "What animal does Sam keep in the backyard?"
        before = [h.entity_id for h in plain.search(question, k=5)]
        assert "notes/pond" not in before  # the question alone does not reach it
        plain.index.close()
        mem = hutch.Memory(store_dir, reasoner=hutch.OpenAIReasoner(fake.url, "fake-model", api_key="k"))
        hits = mem.search(question, k=5)
        assert hits[0].entity_id == "notes/pond" and hits[0].channels["reasoner"]["rank"] == 1
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
        assert len(fake.requests) == 2 and {r["model"] for r in fake.requests} == {"fake-model"}
        assert all(r["auth"] == "Bearer k" and r["path"] == "/v1/chat/completions" for r in fake.requests)
        rerank = fake.requests[1]["messages"][1]["content"]
        assert rerank.startswith(f"Question: {question}") and rerank.count("\n[") == _reason.RERANK
        assert mem.doctor().reasoner_error is None
        # the endpoint fails: the search answers as without a reasoner, and says why
        fake.fail = True
        hits = mem.search(question, k=5)
        assert [h.entity_id for h in hits] == before and "reasoner" not in hits[0].channels
        assert fake.url in mem.index.reasoner_error
        report = mem.doctor()
        assert report.reasoner_error and any(line.startswith("reasoner failed") for line in report.lines())
        mem.index.close()


def test_no_reasoner_by_default_and_a_bad_url_is_refused(store_dir):
    mem = hutch.Memory(store_dir)
    assert mem.reasoner is None and mem.index.reasoner is None
    with pytest.raises(hutch.ConfigError, match="http://"):
        hutch.OpenAIReasoner("localhost:8000", "m")
    assert _reason.reorder(4, [2, 2, 9, 0]) == [2, 0, 1, 3]  # each once, in range, the rest after
    mem.index.close()
