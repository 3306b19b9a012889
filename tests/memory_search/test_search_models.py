"""Embedding providers: the model identity is recorded; a changed model is a new vector space, never mixed.

The OpenAI-compatible provider is tested against FakeEmbeddingServer, a fake (an HTTP server on loopback that
answers /embeddings with deterministic bag-of-words vectors): the external API is the only thing faked.
"""

import hashlib
import json
from http.server import BaseHTTPRequestHandler

import numpy as np
import pytest
from hutch_testing import LoopbackHTTP

import hutch
from hutch.memory._index import MiniLMProvider, OpenAIEmbeddings, default_provider


class FakeEmbeddingServer(LoopbackHTTP):
    """A fake OpenAI-compatible embeddings endpoint on 127.0.0.1 (named as a fake: it is not a model)."""

    def __init__(self, dim=64):
        self.dim = dim
        self.requests = 0
        self.fail = False
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests += 1
                if fake.fail or self.path != "/v1/embeddings":
                    self.send_response(503)
                    self.end_headers()
                    return
                data = [{"index": i, "embedding": fake.vector(t)} for i, t in enumerate(body["input"])]
                out = json.dumps({"object": "list", "data": data, "model": body["model"]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        super().__init__(Handler)

    def vector(self, text):
        v = np.zeros(self.dim)
        for w in text.lower().split():
            v[int(hashlib.md5(w.strip(".,!?").encode()).hexdigest(), 16) % self.dim] += 1
        return v.tolist()

    @property
    def url(self):
        return f"{self.origin}/v1"


@pytest.fixture
def fake_server():
    with FakeEmbeddingServer() as s:
        yield s


def test_identity_recorded_and_model_change_rebuilds_a_new_space(store_dir):
    mem = hutch.Memory(store_dir)
    mem.put("notes", "Churn", body="Many subscribers cancelled their plans.")
    mem.put("notes", "Lunch", body="Tacos on Tuesday.")
    r1 = mem.reindex()
    p = default_provider()
    assert (r1.model, r1.model_revision, r1.dim) == (p.name, p.revision, 384)
    assert r1.vectors == 2 and r1.space_changed_from is None
    mem.index.close()
    # the same weights with another setting is another revision: the old vectors must not be reused
    other = MiniLMProvider(max_tokens=64)
    assert other.revision != p.revision
    mem2 = hutch.Memory(store_dir, embedder=other)
    hits = mem2.search("customers leaving", k=1)
    assert hits[0].entity_id == "notes/churn" and "dense" in hits[0].channels
    r2 = mem2.doctor()
    assert r2.model_revision == other.revision and r2.space_changed_from.endswith(f"rev {p.revision} dim 384")
    assert r2.vectors == 2 and r2.pending_vectors == 0 and r2.ok
    mem2.index.close()


def test_openai_compatible_provider_against_a_fake_server(store_dir, fake_server):
    prov = OpenAIEmbeddings(fake_server.url, "fake-embed-1")
    mem = hutch.Memory(store_dir, embedder=prov)
    mem.put("notes", "Kayak", body="paddle river kayak trip")
    mem.put("notes", "Bread", body="sourdough starter flour")
    hits = mem.search("kayak", k=2)
    assert hits[0].entity_id == "notes/kayak" and "dense" in hits[0].channels
    r = mem.doctor()
    assert (r.model, r.dim) == ("openai:fake-embed-1", 64) and r.vectors == 2
    mem.index.close()
    # a different dimension from the same endpoint name is a different space
    fake_server.dim = 32
    mem2 = hutch.Memory(store_dir, embedder=OpenAIEmbeddings(fake_server.url, "fake-embed-2"))
    assert mem2.search("kayak", k=1)[0].entity_id == "notes/kayak"
    r2 = mem2.doctor()
    assert r2.dim == 32 and "fake-embed-1" in r2.space_changed_from and r2.ok
    mem2.index.close()


def test_failing_endpoint_keeps_lexical_search_working(store_dir, fake_server):
    prov = OpenAIEmbeddings(fake_server.url, "fake-embed-1", dim=64)
    mem = hutch.Memory(store_dir, embedder=prov)
    mem.put("notes", "Kayak", body="paddle river kayak trip")
    fake_server.fail = True
    hits = mem.search("kayak", k=1)  # the vectors cannot be made: words still answer
    assert hits[0].entity_id == "notes/kayak" and set(hits[0].channels) <= {"bm25", "entity"}
    r = mem.doctor()
    assert not r.ok and r.pending_vectors == 1 and "503" in r.embed_error
    fake_server.fail = False
    assert "dense" in mem.search("kayak", k=1)[0].channels
    assert mem.doctor().ok
    mem.index.close()


def test_provider_arguments_are_checked():
    with pytest.raises(hutch.ConfigError, match="http"):
        OpenAIEmbeddings("127.0.0.1:9/v1", "m")
    with pytest.raises(hutch.ConfigError, match="max_tokens"):
        MiniLMProvider(max_tokens=4)
    with pytest.raises(hutch.ConfigError, match="does not exist"):
        MiniLMProvider("/nonexistent/model.onnx")


def test_endpoint_down_from_the_start_keeps_lexical_search(store_dir, fake_server):
    """The provider cannot even say its dimension: no vector space is chosen, words still answer."""
    fake_server.fail = True
    mem = hutch.Memory(store_dir, embedder=OpenAIEmbeddings(fake_server.url, "fake-embed-1"))
    mem.put("notes", "Kayak", body="paddle river kayak trip")
    hits = mem.search("kayak", k=1)
    assert hits[0].entity_id == "notes/kayak" and "dense" not in hits[0].channels
    assert not mem.doctor().ok and "503" in mem.doctor().embed_error
    fake_server.fail = False
    assert "dense" in mem.search("kayak", k=1)[0].channels
    assert mem.doctor().ok and mem.doctor().dim == 64
    mem.index.close()
