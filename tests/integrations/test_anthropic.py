"""Claude's client-side tools served by hutch, driven by the official anthropic client against a scripted
Messages API on loopback (the only fake): the memory tool over a real store, bash and the text editor in a
real sandbox; both handle() and the SDK's own tool runner."""

from __future__ import annotations

import subprocess

import pytest

pytest.importorskip("anthropic", reason="pip install 'hutch[anthropic]'")

import anthropic  # noqa: E402

from hutch.integrations import anthropic as ha  # noqa: E402

from fake_llm import ScriptedAPI, claude_text, claude_tool_use, result_text, tool_results  # noqa: E402


def loop(api: ScriptedAPI, *, sandbox=None, memory=None, max_turns: int = 10) -> list:
    """The agent loop of the module's docstring, against the scripted API."""
    client = anthropic.Anthropic(base_url=api.url, api_key="test-key", max_retries=0)
    msgs = [{"role": "user", "content": "go"}]
    for _ in range(max_turns):
        r = client.messages.create(model="claude-fake", max_tokens=256, messages=msgs,
                                   tools=ha.tool_params(sandbox=sandbox, memory=memory))
        msgs.append({"role": "assistant", "content": r.content})
        if r.stop_reason != "tool_use":
            return msgs
        msgs.append({"role": "user", "content": ha.handle(r, sandbox=sandbox, memory=memory)})
    raise AssertionError("the loop did not end")


def commits(mem) -> int:
    return int(subprocess.run(["git", "-C", str(mem.root), "rev-list", "--count", "HEAD"], capture_output=True,
                              text=True, check=True).stdout)


def test_memory_tool_every_command_lands_in_the_store_with_the_calls_provenance(store):
    turns = [
        claude_tool_use(("t1", "memory", {"command": "view", "path": "/memories"})),
        claude_tool_use(("t2", "memory", {"command": "create", "path": "/memories/prefs/user.md",
                                          "file_text": "# User\n- likes tea\n"})),
        claude_tool_use(("t3", "memory", {"command": "str_replace", "path": "/memories/prefs/user.md",
                                          "old_str": "likes tea", "new_str": "likes green tea"})),
        claude_tool_use(("t4", "memory", {"command": "insert", "path": "/memories/prefs/user.md",
                                          "insert_line": 1, "insert_text": "- works at Acme"})),
        claude_tool_use(("t5", "memory", {"command": "view", "path": "/memories/prefs/user.md"})),
        claude_tool_use(("t6", "memory", {"command": "rename", "old_path": "/memories/prefs/user.md",
                                          "new_path": "/memories/people/me.txt"})),
        claude_tool_use(("t7", "memory", {"command": "view", "path": "/memories/actors/alice-chen.md",
                                          "view_range": [1, 1]})),
        claude_tool_use(("t8", "memory", {"command": "delete", "path": "/memories/topics"})),
        claude_text("Remembered."),
    ]
    n0 = commits(store)
    with ScriptedAPI(turns) as api:
        loop(api, memory=store)
    sent = {k: v for req in api.requests[1:] for k, v in tool_results(req).items()}
    assert api.requests[0]["tools"] == [{"type": "memory_20250818", "name": "memory"}]
    assert not any(b.get("is_error") for b in sent.values()), sent
    view = result_text(sent["t1"])
    assert "/memories/actors/alice-chen.md" in view and "/memories/orgs/" in view
    assert result_text(sent["t5"]).splitlines()[1:] == ["     1\t# User", "     2\t- works at Acme",
                                                       "     3\t- likes green tea", "     4\t"]
    assert result_text(sent["t7"]).splitlines()[1:] == ["     1\tHead of data at Acme."]
    # what landed: the renamed entity with its text, the old one and the deleted class gone, one commit each
    assert not store.exists("prefs/user") and store.exists("people/me.txt")
    assert store.get("people/me.txt").body == "\n# User\n- works at Acme\n- likes green tea\n"
    assert (store.root / "people" / "me.txt.md").is_file()
    assert not store.exists("topics/pricing") and "topics" not in store.classes()
    assert commits(store) == n0 + 5   # create, str_replace, insert, rename, delete: one each; views none
    hist = store.history("people/me.txt")
    assert hist[0].source == "anthropic:t6"
    old = store.history("prefs/user")
    assert [v.source for v in old] == ["anthropic:t6", "anthropic:t4", "anthropic:t3", "anthropic:t2"]
    assert store.check().ok


def test_rename_keeps_links_in_and_out(store):
    with ScriptedAPI([claude_tool_use(("r", "memory", {"command": "rename", "old_path": "/memories/orgs/acme.md",
                                                       "new_path": "/memories/companies/acme.md"})),
                      claude_text("ok")]) as api:
        loop(api, memory=store)
    assert store.get("actors/alice-chen").link_ids["works_at"] == ("companies/acme",)
    assert "churn" in store.get("companies/acme").body and store.check().ok


BAD_MEMORY = [
    {"command": "view", "path": "/etc/passwd"},
    {"command": "view", "path": "/memories/../../etc/passwd"},
    {"command": "view", "path": "/memories/.git/config"},
    {"command": "create", "path": "/memories/.hutch/index.sqlite", "file_text": "x"},
    {"command": "create", "path": "/memories/notes.md", "file_text": "top level"},
    {"command": "create", "path": "/memories/a/b/c.md", "file_text": "too deep"},
    {"command": "create", "path": "/memories/Bad Dir/x.md", "file_text": "x"},
    {"command": "create", "path": "/memories/notes/big.md", "file_text": "x" * (2 << 20)},
    {"command": "create", "path": "/memories/notes/t.md", "file_text": 42},
    {"command": "create", "path": "/memories/actors/alice-chen.md", "file_text": "clobber"},
    {"command": "str_replace", "path": "/memories/actors/alice-chen.md", "old_str": "nowhere", "new_str": "x"},
    {"command": "str_replace", "path": "/memories/actors/alice-chen.md", "old_str": "", "new_str": "x"},
    {"command": "insert", "path": "/memories/actors/alice-chen.md", "insert_line": 999, "insert_text": "x"},
    {"command": "insert", "path": "/memories/actors/alice-chen.md", "insert_line": "one", "insert_text": "x"},
    {"command": "delete", "path": "/memories"},
    {"command": "delete", "path": "/memories/nothing/here.md"},
    {"command": "rename", "old_path": "/memories/orgs/acme.md", "new_path": "/memories/actors/alice-chen.md"},
    {"command": "rename", "old_path": "/memories/orgs", "new_path": "/memories/x/y.md"},
    {"command": "explode"},
    "not an object",
]


# the scripted model sends a tool_use whose input is not an object (the last of BAD_MEMORY); the anthropic client,
# sending that block back in the next request, serializes it against its own ToolUseBlock type and pydantic warns
# (UserWarning: Pydantic serializer warnings) inside the anthropic package
@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")
def test_bad_memory_input_is_an_error_result_and_nothing_changes(store):
    n0 = commits(store)
    text0 = {i: store.get(i).text for i in store.ls()}
    calls = [(f"b{i}", "memory", a) for i, a in enumerate(BAD_MEMORY)]
    with ScriptedAPI([claude_tool_use(*calls), claude_text("sorry")]) as api:
        msgs = loop(api, memory=store)
    sent = tool_results(api.requests[1])
    assert set(sent) == {c[0] for c in calls}
    for cid, _, a in calls:
        assert sent[cid].get("is_error") is True, (a, sent[cid])
        assert 0 < len(result_text(sent[cid])) < 2000
    assert "Path must start with /memories" in result_text(sent["b0"])
    assert "/memories/notes/notes.md" in result_text(sent["b4"])
    assert "already exists" in result_text(sent["b9"])
    assert msgs[-1]["content"][0].text == "sorry"
    assert commits(store) == n0 and {i: store.get(i).text for i in store.ls()} == text0
    assert not (store.root / ".." / "etc").exists() and store.check().ok


def test_bash_and_editor_in_a_sandbox_keep_shell_state(sb):
    turns = [
        claude_tool_use(("b1", "bash", {"command": "mkdir -p /home/user/proj && cd /home/user/proj && X=7"})),
        claude_tool_use(("b2", "bash", {"command": "pwd; echo $X; ls /nope"})),
        claude_tool_use(("e1", "str_replace_based_edit_tool", {"command": "create", "path": "/home/user/proj/app.py",
                                                                "file_text": "print('hi')\nx = 1\n"})),
        claude_tool_use(("e2", "str_replace_based_edit_tool", {"command": "str_replace", "path": "/home/user/proj/app.py",
                                                                "old_str": "x = 1", "new_str": "x = 2"})),
        claude_tool_use(("e3", "str_replace_based_edit_tool", {"command": "insert", "path": "/home/user/proj/app.py",
                                                                "insert_line": 0, "insert_text": "# app"})),
        claude_tool_use(("e4", "str_replace_based_edit_tool", {"command": "view", "path": "/home/user/proj/app.py"})),
        claude_tool_use(("e5", "str_replace_based_edit_tool", {"command": "view", "path": "/home/user"})),
        claude_tool_use(("b3", "bash", {"command": "cat app.py | wc -l; exit 3"})),
        claude_tool_use(("b4", "bash", {"command": "pwd"})),
        claude_tool_use(("b5", "bash", {"command": "sleep 30", "timeout": 1})),
        claude_tool_use(("b6", "bash", {"restart": True})),
        claude_tool_use(("b7", "bash", {"command": "echo fresh; cd /tmp; pwd"})),
        claude_text("done"),
    ]
    with ScriptedAPI(turns) as api:
        loop(api, sandbox=sb, max_turns=20)
    got = {k: v for req in api.requests[1:] for k, v in tool_results(req).items()}
    assert api.requests[0]["tools"] == [{"type": "bash_20250124", "name": "bash"},
                                        {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}]
    assert result_text(got["b1"]) == "(no output)" and not got["b1"].get("is_error")
    assert got["b2"]["is_error"] and result_text(got["b2"]).startswith("/home/user/proj\n7\nls: /nope")
    assert "[exit code 1]" in result_text(got["b2"])
    assert sb.files.read("/home/user/proj/app.py") == b"# app\nprint('hi')\nx = 2\n"
    assert result_text(got["e4"]).splitlines() == ["     1\t# app", "     2\tprint('hi')", "     3\tx = 2", "     4\t"]
    assert "/home/user/proj/app.py" in result_text(got["e5"])
    assert got["b3"]["is_error"] and "3" in result_text(got["b3"]) and "exited" in result_text(got["b3"])
    assert "the next command starts a new one" in result_text(got["b3"])
    assert result_text(got["b4"]) == "/home/user"   # a new shell: the cd of b1 is gone
    assert got["b5"]["is_error"] and "timed out" in result_text(got["b5"])
    assert "restarted" in result_text(got["b6"])
    assert result_text(got["b7"]) == "fresh\n/tmp"
    assert sb.run("true").returncode == 0   # the caller's sandbox is still theirs


def test_bash_output_is_bounded_and_a_flood_is_cut(sb):
    with ScriptedAPI([claude_tool_use(("f", "bash", {"command": "yes 0123456789 | head -c 3000000; echo END"})),
                      claude_text("ok")]) as api:
        loop(api, sandbox=sb)
    out = result_text(tool_results(api.requests[1])["f"])
    assert len(out) < 110_000 and out.endswith("END") and "dropped" in out


def test_bad_editor_and_bash_input_is_an_error_result(sb):
    bad = [("str_replace_based_edit_tool", {"command": "view", "path": "relative.txt"}),
           ("str_replace_based_edit_tool", {"command": "view", "path": "/nonexistent"}),
           ("str_replace_based_edit_tool", {"command": "create", "path": "/home/user/x", "file_text": None}),
           ("str_replace_based_edit_tool", {"command": "create", "path": "/home/user/x", "file_text": "y" * (5 << 20)}),
           ("str_replace_based_edit_tool", {"command": "str_replace", "path": "/bin/busybox", "old_str": "a"}),
           ("str_replace_based_edit_tool", {"command": "undo_edit", "path": "/home/user/x"}),
           ("bash", {"command": ["ls"]}), ("bash", {}), ("bash", {"command": "true", "timeout": "soon"})]
    calls = [(f"x{i}", n, a) for i, (n, a) in enumerate(bad)]
    with ScriptedAPI([claude_tool_use(*calls), claude_text("ok")]) as api:
        loop(api, sandbox=sb)
    sent = tool_results(api.requests[1])
    for cid, _, a in calls:
        assert sent[cid].get("is_error") is True, (a, sent[cid])
    assert "absolute" in result_text(sent["x0"]) and "undo_edit" in result_text(sent["x5"])


def test_the_sdks_tool_runner_drives_hutchs_tool_objects(store, sb):
    turns = [claude_tool_use(("m1", "memory", {"command": "create", "path": "/memories/notes/run.md",
                                               "file_text": "via the runner"}),
                             ("s1", "bash", {"command": "echo from-bash > /tmp/r; cat /tmp/r"})),
             claude_text("all done")]
    with ScriptedAPI(turns) as api:
        client = anthropic.Anthropic(base_url=api.url, api_key="test-key", max_retries=0)
        runner = client.beta.messages.tool_runner(model="claude-fake", max_tokens=256,
                                                  messages=[{"role": "user", "content": "go"}],
                                                  tools=ha.tools(sandbox=sb, memory=store))
        final = runner.until_done()
    assert final.content[0].text == "all done"
    sent = tool_results(api.requests[1])
    assert result_text(sent["s1"]) == "from-bash" and "created" in result_text(sent["m1"])
    assert store.get("notes/run").body == "\nvia the runner"
    assert store.history("notes/run")[0].source == "anthropic:memory"
    names = [t["name"] for t in api.requests[0]["tools"]]
    assert names == ["bash", "str_replace_based_edit_tool", "memory"]


def test_a_tool_hutch_was_not_given_says_what_to_pass(store):
    with ScriptedAPI([claude_tool_use(("b", "bash", {"command": "ls"}), ("o", "other_tool", {})),
                      claude_text("ok")]) as api:
        client = anthropic.Anthropic(base_url=api.url, api_key="k", max_retries=0)
        r = client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        res = ha.handle(r, memory=store)
    assert [x["tool_use_id"] for x in res] == ["b"] and res[0]["is_error"] and "sandbox=" in res[0]["content"]


def test_a_huge_file_is_viewed_in_bounded_pieces(store, sb):
    big = "".join(f"line {i} " + "x" * 60 + "\n" for i in range(20_000))   # 1.3 MB
    store.put("notes", "big", body="\n" + big[:1_000_000], slug="big")
    sb.files.write("/home/user/big.txt", big)
    with ScriptedAPI([claude_tool_use(("m", "memory", {"command": "view", "path": "/memories/notes/big.md"}),
                                      ("e", "str_replace_based_edit_tool", {"command": "view",
                                                                            "path": "/home/user/big.txt"})),
                      claude_text("ok")]) as api:
        loop(api, sandbox=sb, memory=store)
    sent = tool_results(api.requests[1])
    for k in ("m", "e"):
        text = result_text(sent[k])
        assert len(text) < 210_000 and "view_range [" in text.splitlines()[-1], text[-300:]
