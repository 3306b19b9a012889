"""The MCP server through the official MCP Python SDK client: stdio and streamable HTTP, real store, real sandboxes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters

import hutch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuse"))
from sandbox_support import busybox_root, private_daemon  # noqa: E402

MEMORY_TOOLS = {"memory_search", "memory_get", "memory_list", "memory_put", "memory_link", "memory_history"}
SANDBOX_TOOLS = {"sandbox_create", "sandbox_exec", "sandbox_read_file", "sandbox_write_file", "sandbox_list",
                 "sandbox_terminate"}


@pytest.fixture(scope="module")
def daemon():
    with private_daemon() as env:
        yield env


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return "dir:" + str(busybox_root(tmp_path_factory.mktemp("bb") / "root"))


@pytest.fixture
def store(tmp_path):
    mem = hutch.Memory(tmp_path / "store")
    acme = mem.put("orgs", "Acme", body="Acme worries about customer churn after onboarding.")
    mem.link(mem.put("actors", "Alice Chen", body="Head of data."), "works_at", acme)
    return mem


def _params(store, image, daemon) -> StdioServerParameters:
    env = {**daemon, "PATH": os.environ["PATH"]}
    return StdioServerParameters(command=sys.executable, args=["-m", "hutch", "mcp", "--store", str(store.root),
                                                               "--image", image], env=env)


def _call(client, name, args):
    async def go():
        return await client.call_tool(name, args)
    return go()


async def _memory_session(client, store):
    tools = {t.name: t for t in (await client.list_tools()).tools}
    assert MEMORY_TOOLS | SANDBOX_TOOLS <= set(tools)
    assert tools["memory_search"].annotations.read_only_hint is True
    assert tools["memory_put"].annotations.read_only_hint is False
    assert tools["sandbox_terminate"].annotations.destructive_hint is True
    assert "query" in tools["memory_search"].input_schema["properties"]
    assert "now" in tools["memory_search"].input_schema["properties"]  # relative time words' reference
    assert "Search the memory store" in tools["memory_search"].description

    r = await client.call_tool("memory_search", {"q": "customer churn", "k": 3})  # alias q
    assert not r.is_error
    hits = r.structured_content["result"]["hits"]
    assert hits[0]["id"] == "orgs/acme" and "bm25" in hits[0]["channels"]
    assert hits[0]["anchor"] is None and hits[0]["speaker"] is None  # not a conversation turn

    r = await client.call_tool("memory_put", {"title": "Pricing decision", "entity_class": "decisions",
                                              "body": "Move to tiered pricing.", "facts": ["decided 2026-11-20"],
                                              "source": "chat:42"})
    assert not r.is_error and r.structured_content["result"]["created"] is True
    did = r.structured_content["result"]["id"]
    r = await client.call_tool("memory_link", {"from_id": did, "relation": "decided_by", "to_id": "actors/alice-chen"})
    assert not r.is_error
    r = await client.call_tool("memory_get", {"entity_id": did})  # alias entity_id
    e = r.structured_content["result"]
    assert e["facts"] == ["decided 2026-11-20"] and e["links"] == {"decided_by": ["actors/alice-chen"]}
    r = await client.call_tool("memory_history", {"id": did})
    ops = [(v["op"], v["source"]) for v in r.structured_content["result"]["versions"]]
    assert ops == [("link", "mcp"), ("put", "chat:42")]
    assert store.get(did).body.strip().startswith("Move to tiered pricing.")

    r = await client.call_tool("memory_get", {"id": "orgs/nobody"})
    assert r.is_error and "EntityNotFoundError" in r.content[0].text and "hutch mem ls" in r.content[0].text
    r = await client.call_tool("memory_search", {})
    assert r.is_error and "needs a query" in r.content[0].text


async def _sandbox_session(client, store):
    r = await client.call_tool("sandbox_create", {"timeout": 120, "tags": {"t": "mcp-test"}})
    assert not r.is_error, r.content
    sid = r.structured_content["result"]["sandbox_id"]
    try:
        r = await client.call_tool("sandbox_exec", {"sandbox_id": sid, "command": "echo hi; echo err >&2; exit 3"})
        out = r.structured_content["result"]
        assert (out["exit_code"], out["stdout"], out["stderr"]) == (3, "hi\n", "err\n")
        r = await client.call_tool("sandbox_write_file", {"id": sid, "path": "/home/user/a.txt", "content": "data"})
        assert not r.is_error
        r = await client.call_tool("sandbox_exec", {"id": sid, "cmd": ["cat", "/home/user/a.txt"]})
        assert r.structured_content["result"]["stdout"] == "data"
        r = await client.call_tool("sandbox_read_file", {"sandbox_id": sid, "path": "/home/user/a.txt"})
        assert r.structured_content["result"]["content"] == "data"
        r = await client.call_tool("sandbox_list", {})
        assert sid in [s["id"] for s in r.structured_content["result"]["sandboxes"]]
    finally:
        r = await client.call_tool("sandbox_terminate", {"sandbox_id": sid})
    assert not r.is_error
    r = await client.call_tool("sandbox_exec", {"sandbox_id": sid, "command": "true"})
    assert r.is_error


async def _memory_in_sandbox(client, store):
    r = await client.call_tool("sandbox_create", {"mount_memory": "rw", "timeout": 120})
    assert not r.is_error, r.content
    sid = r.structured_content["result"]["sandbox_id"]
    try:
        r = await client.call_tool("sandbox_exec", {"sandbox_id": sid, "command":
                                                    "ls '/memory/search/customer churn/' && "
                                                    "echo '- seen from a sandbox' >> /memory/orgs/acme.md"})
        out = r.structured_content["result"]
        assert out["exit_code"] == 0 and out["stdout"].splitlines()[0] == "01-orgs-acme.md", out
        assert store.history("orgs/acme")[0].source == f"sandbox:{sid}"
    finally:
        await client.call_tool("sandbox_terminate", {"sandbox_id": sid})


def test_stdio_memory_and_sandboxes(store, image, daemon):
    async def main():
        async with Client(_params(store, image, daemon)) as client:
            await _memory_session(client, store)
            await _sandbox_session(client, store)
            await _memory_in_sandbox(client, store)
    anyio.run(main)
    assert hutch.Sandbox.list(tags={"t": "mcp-test"}) == [] or all(
        s.status != "running" for s in hutch.Sandbox.list(tags={"t": "mcp-test"}))


def _server_pid(store) -> int:
    """The `hutch mcp` process the stdio client started for `store` (a child of this process)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"mcp" in cmd and str(store.root).encode() in cmd:
            return int(pid)
    raise AssertionError("the MCP server process was not found")


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for {pid}")


def test_sandbox_exec_collects_a_capped_amount(store, image, daemon):
    """150 MB of output: the tool result carries the first MAX_OUTPUT bytes and says how much was dropped,
    and the server never held the rest (its peak memory does not grow with the output)."""
    from hutch.mcp._sandbox_tools import MAX_OUTPUT

    async def main():
        async with Client(_params(store, image, daemon)) as client:
            r = await client.call_tool("sandbox_create", {"timeout": 120})
            sid = r.structured_content["result"]["sandbox_id"]
            try:
                server = _server_pid(store)
                before = _peak_rss_mb(server)
                r = await client.call_tool("sandbox_exec", {"sandbox_id": sid, "command":
                                                            "head -c 150000000 /dev/zero | tr '\\0' x; echo end >&2"})
                grew = _peak_rss_mb(server) - before
                assert grew < 64, f"the MCP server's peak memory grew by {grew:.0f} MB for one command's output"
                out = r.structured_content["result"]
                assert (out["exit_code"], out["stderr"], out["stdout"]) == (0, "end\n", "x" * MAX_OUTPUT)
                assert (out["stdout_dropped"], out["stderr_dropped"]) == (150_000_000 - MAX_OUTPUT, 0)
                assert str(MAX_OUTPUT) in out["truncated"]
            finally:
                await client.call_tool("sandbox_terminate", {"sandbox_id": sid})
    anyio.run(main)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_streamable_http(store, image, daemon, tmp_path):
    port = _free_port()
    log = open(tmp_path / "mcp.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "hutch", "mcp", "--store", str(store.root), "--image", image,
                             "--http", "--port", str(port)], stdout=log, stderr=log, env={**os.environ, **daemon})
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "mcp.log").read_text()
                time.sleep(0.1)

        async def main():
            async with Client(f"http://127.0.0.1:{port}/mcp") as client:
                await _memory_session(client, store)
                await _sandbox_session(client, store)
        anyio.run(main)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_http_refuses_a_non_loopback_address_without_allow_remote():
    r = subprocess.run([sys.executable, "-m", "hutch", "mcp", "--http", "--host", "0.0.0.0", "--no-sandboxes"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no authentication" in r.stderr and "--allow-remote" in r.stderr
