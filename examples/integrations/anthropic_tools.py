"""Claude's client-side tools served by hutch: memory (an SMF store), bash and the text editor (a sandbox).

    python examples/integrations/anthropic_tools.py           # scripted model answers: no key needed
    ANTHROPIC_API_KEY=... python examples/integrations/anthropic_tools.py   # a real Claude

Needs: pip install 'hutch[anthropic]' (and root, for the sandbox). The loop is the usual tool-use loop;
hutch.integrations.anthropic.handle() answers the tool_use blocks.
"""

from __future__ import annotations

import os
import tempfile

import anthropic
import hutch
from hutch.integrations import anthropic as ha

MODEL = os.environ.get("ANTHROPIC_MODEL", "claude-sonnet-4-5")


def scripted():
    """Stand-in answers of a model (anthropic Message objects), used when no API key is set."""
    turns = [
        [("m1", "memory", {"command": "view", "path": "/memories"})],
        [("m2", "memory", {"command": "create", "path": "/memories/user/preferences.md",
                           "file_text": "- likes green tea\n"})],
        [("b1", "str_replace_based_edit_tool", {"command": "create", "path": "/home/user/count.sh",
                                                 "file_text": "ls /etc | wc -l\n"})],
        [("b2", "bash", {"command": "cd /home/user && sh count.sh"})],
    ]
    for i, calls in enumerate(turns):
        yield anthropic.types.Message.model_validate({
            "id": f"msg_{i}", "type": "message", "role": "assistant", "model": "scripted",
            "content": [{"type": "tool_use", "id": c, "name": n, "input": a} for c, n, a in calls],
            "stop_reason": "tool_use", "usage": {"input_tokens": 0, "output_tokens": 0}})
    yield anthropic.types.Message.model_validate({
        "id": "msg_end", "type": "message", "role": "assistant", "model": "scripted",
        "content": [{"type": "text", "text": "Noted your tea preference; /etc holds that many entries."}],
        "stop_reason": "end_turn", "usage": {"input_tokens": 0, "output_tokens": 0}})


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="hutch-example-") as tmp:   # the example's memory, removed after it
        demo(hutch.Memory(os.path.join(tmp, "memory")))


def demo(mem: hutch.Memory) -> None:
    client = anthropic.Anthropic() if os.environ.get("ANTHROPIC_API_KEY") else None
    fake = scripted()
    with hutch.Sandbox.create(timeout=300) as sb:
        msgs = [{"role": "user", "content": "Remember that I like green tea. Then count the entries of /etc "
                                            "with a small script."}]
        while True:
            r = (client.messages.create(model=MODEL, max_tokens=1024, messages=msgs,
                                        tools=ha.tool_params(sandbox=sb, memory=mem)) if client else next(fake))
            msgs.append({"role": "assistant", "content": r.content})
            if r.stop_reason != "tool_use":
                break
            results = ha.handle(r, sandbox=sb, memory=mem)
            for res in results:
                print(f"{res['tool_use_id']}: {'ERROR ' if res.get('is_error') else ''}{str(res['content'])[:120]!r}")
            msgs.append({"role": "user", "content": results})
    print("claude:", r.content[0].text)
    for eid in mem.ls():
        print(f"memory {eid}: source {mem.history(eid)[0].source}")


if __name__ == "__main__":
    main()
