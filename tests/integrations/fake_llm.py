"""A scripted model API on loopback: the one fake of the adapter tests, at the model boundary.

`ScriptedAPI(turns)` serves POST requests (Anthropic /v1/messages, OpenAI /v1/responses and
/v1/chat/completions) on 127.0.0.1 with the next scripted JSON answer, and records every request body, so
a test checks both what the official client sent (tool results included) and what the adapter did.
A turn is a dict (the answer) or a callable(request_body) -> dict.
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler

from hutch_testing import LoopbackHTTP


class ScriptedAPI(LoopbackHTTP):
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

        super().__init__(Handler)
        self.url = self.origin


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


# ------------------------------------------------------------------ OpenAI answers

_USAGE = {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2, "input_tokens_details": {"cached_tokens": 0},
          "output_tokens_details": {"reasoning_tokens": 0}}


def responses_calls(*calls, rid: str = "resp_1") -> dict:
    """A Responses API answer asking for function calls: (call_id, name, arguments: dict or raw str)."""
    out = [{"type": "function_call", "id": f"fc_{c}", "call_id": c, "name": n, "status": "completed",
            "arguments": a if isinstance(a, str) else json.dumps(a)} for c, n, a in calls]
    return {"id": rid, "object": "response", "created_at": 0, "status": "completed", "model": "gpt-fake",
            "output": out, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "usage": _USAGE}


def responses_text(text: str, rid: str = "resp_end") -> dict:
    msg = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
           "content": [{"type": "output_text", "text": text, "annotations": []}]}
    return {"id": rid, "object": "response", "created_at": 0, "status": "completed", "model": "gpt-fake",
            "output": [msg], "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "usage": _USAGE}


def chat_calls(*calls) -> dict:
    tcs = [{"id": c, "type": "function", "function": {"name": n, "arguments": a if isinstance(a, str) else json.dumps(a)}}
           for c, n, a in calls]
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "gpt-fake",
            "choices": [{"index": 0, "finish_reason": "tool_calls",
                         "message": {"role": "assistant", "content": None, "tool_calls": tcs}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def chat_text(text: str) -> dict:
    return {"id": "chatcmpl-2", "object": "chat.completion", "created": 0, "model": "gpt-fake",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def function_outputs(request: dict) -> dict[str, str]:
    """call_id -> output of the function_call_output items a Responses request carried."""
    items = request.get("input") or []
    return {i["call_id"]: i["output"] for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"}
