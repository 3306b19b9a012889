"""A scripted model API on loopback: the one fake of the adapter tests, at the model boundary.

`ScriptedAPI(turns)` serves POST requests (Anthropic /v1/messages, OpenAI /v1/responses and
/v1/chat/completions) on 127.0.0.1 with the next scripted JSON answer, and records every request body, so
a test checks both what the official client sent (tool results included) and what the adapter did.
A turn is a dict (the answer) or a callable(request_body) -> dict.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ScriptedAPI:
    def __init__(self, turns):
        self.turns = list(turns)
        self.requests: list[dict] = []
        self.paths: list[str] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
                api.requests.append(body)
                api.paths.append(self.path)
                if not api.turns:
                    self._send(500, {"error": {"type": "api_error", "message": "the script has no more turns"}})
                    return
                turn = api.turns.pop(0)
                self._send(200, turn(body) if callable(turn) else turn)

            def _send(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._t = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


# ------------------------------------------------------------------ Anthropic Messages answers

def claude_tool_use(*calls, mid: str = "msg_1") -> dict:
    """An assistant message asking for tools: calls are (id, name, input)."""
    return {"id": mid, "type": "message", "role": "assistant", "model": "claude-fake",
            "content": [{"type": "tool_use", "id": i, "name": n, "input": a} for i, n, a in calls],
            "stop_reason": "tool_use", "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}


def claude_text(text: str, mid: str = "msg_end") -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": "claude-fake",
            "content": [{"type": "text", "text": text}], "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 1}}


def tool_results(request: dict) -> dict[str, dict]:
    """tool_use_id -> the tool_result block the client sent in its last user message."""
    last = request["messages"][-1]
    return {b["tool_use_id"]: b for b in last["content"] if isinstance(b, dict) and b.get("type") == "tool_result"}


def result_text(block: dict) -> str:
    c = block.get("content")
    if isinstance(c, list):
        return "".join(x.get("text", "") for x in c)
    return c or ""
