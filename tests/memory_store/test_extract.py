"""The optional LLM extractor, against a FAKE OpenAI-compatible server on loopback (the true external boundary)."""

import json
from http.server import BaseHTTPRequestHandler

import pytest
from hutch_testing import LoopbackHTTP

import hutch
from hutch.memory._extract import Extractor, OpenAIExtractor

CANNED = {
    "entities": [
        {"class": "actors", "title": "Ann", "facts": ["adopted a dog named Rex"]},
        {"class": "Pets", "title": "Rex", "facts": []},
    ],
    "links": [
        {"from": {"class": "actors", "title": "Ann"}, "relation": "owns", "to": {"class": "pets", "title": "Rex"}},
        {"from": {"class": "actors"}, "relation": "broken", "to": {}},  # malformed: dropped, not fatal
    ],
}


class FakeOpenAIServer(LoopbackHTTP):
    """A FAKE chat-completions endpoint: records requests, answers with a canned JSON extraction."""

    def __init__(self, answer):
        self.requests = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, dict(self.headers), body))
                data = json.dumps({"choices": [{"message": {"role": "assistant",
                                                            "content": json.dumps(answer)}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        super().__init__(Handler)
        self.url = f"{self.origin}/v1"


def test_extractor_proposals_are_written_and_linked(mem):
    with FakeOpenAIServer(CANNED) as fake:
        ex = OpenAIExtractor(fake.url, "fake-model", api_key="k")
        assert isinstance(ex, Extractor)
        mem.ingest_text("Ann adopted a dog. His name is Rex.", title="Chat note", cls="notes", extractor=ex)
    path, headers, body = fake.requests[0]
    assert path == "/v1/chat/completions" and headers["Authorization"] == "Bearer k"
    assert body["model"] == "fake-model" and "Ann adopted a dog" in body["messages"][-1]["content"]
    assert mem.get("actors/ann").facts == ["adopted a dog named Rex"]
    assert mem.get("actors/ann").link_ids == {"mentioned_in": ("notes/chat-note",), "owns": ("pets/rex",)}
    assert mem.exists("pets/rex")
    assert mem.check().ok


def test_extractor_endpoint_down_is_a_clear_error_and_writes_nothing(mem):
    ex = OpenAIExtractor("http://127.0.0.1:9/v1", "m", timeout=2)
    with pytest.raises(hutch.MemoryStoreError, match="without an extractor"):
        mem.ingest_text("text", title="T", extractor=ex)
    assert mem.ls() == []


def test_model_answer_that_is_not_json_is_rejected(mem):
    with FakeOpenAIServer("not json at all") as fake:
        # the fake returns a JSON *string*: valid JSON but not an object
        with pytest.raises(hutch.MemoryStoreError, match="JSON object"):
            mem.ingest_text("text", title="T", extractor=OpenAIExtractor(fake.url, "m"))
    assert mem.ls() == []
