"""The MCP server through the official MCP Python SDK client: stdio and streamable HTTP, real store, real sandboxes."""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import sys
import time
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import anyio
import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

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


@contextmanager
def http_server(tmp_path, *args: str, env: dict | None = None):
    """`hutch mcp --http ARGS` on a free loopback port; yields (url, log path) once it listens."""
    port = _free_port()
    log_path = tmp_path / f"mcp-{port}.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "hutch", "mcp", *args, "--http", "--port", str(port)],
                            stdout=log, stderr=log, env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp", log_path
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _token_file(tmp_path) -> tuple[Path, str]:
    token = secrets.token_urlsafe(24)
    p = tmp_path / "mcp-token"
    p.write_text(token)
    os.chmod(p, 0o600)
    return p, token


@asynccontextmanager
async def _authed(url: str, token: str):
    """An MCP client over streamable HTTP with a bearer token; the HTTP client it is given is ours to close (the
    SDK closes only one it made itself)."""
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"},
                                  timeout=httpx2.Timeout(30, read=300)) as http:
        async with Client(streamable_http_client(url, http_client=http)) as client:
            yield client


def test_streamable_http(store, image, daemon, tmp_path):
    tf, token = _token_file(tmp_path)
    with http_server(tmp_path, "--store", str(store.root), "--image", image, "--token-file", str(tf),
                     env=daemon) as (url, _):
        async def main():
            async with _authed(url, token) as client:
                await _memory_session(client, store)
                await _sandbox_session(client, store)
        anyio.run(main)


def _status(url: str, headers: dict) -> int:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    return httpx.post(url, json=body, headers={"Accept": "application/json, text/event-stream", **headers},
                      timeout=10).status_code


def test_http_needs_the_token(tmp_path):
    tf, token = _token_file(tmp_path)
    with http_server(tmp_path, "--no-sandboxes", "--token-file", str(tf)) as (url, _):
        assert _status(url, {}) == 401
        assert _status(url, {"Authorization": f"Bearer {token}x"}) == 401
        assert _status(url, {"Authorization": token}) == 401
        assert _status(url, {"Authorization": f"Bearer {token}"}) != 401

        async def main():
            async with _authed(url, "wrong-" + token) as client:
                await client.list_tools()
        with pytest.raises(BaseException):
            anyio.run(main)
    # without --token-file or $HUTCH_MCP_TOKEN a token is made, printed, and required
    with http_server(tmp_path, "--no-sandboxes") as (url, log):
        printed = re.search(r"Authorization: Bearer (\S+)", log.read_text()).group(1)
        assert _status(url, {}) == 401 and _status(url, {"Authorization": f"Bearer {printed}"}) != 401
    with http_server(tmp_path, "--no-sandboxes", env={"HUTCH_MCP_TOKEN": token}) as (url, log):
        assert token not in log.read_text()
        assert _status(url, {}) == 401 and _status(url, {"Authorization": f"Bearer {token}"}) != 401


def test_http_refuses_a_non_loopback_address_without_allow_remote():
    r = subprocess.run([sys.executable, "-m", "hutch", "mcp", "--http", "--host", "0.0.0.0", "--no-sandboxes"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "plain HTTP" in r.stderr and "--allow-remote" in r.stderr


async def _create_error(client, args) -> str:
    r = await client.call_tool("sandbox_create", {"timeout": 60, **args})
    assert r.is_error, r.structured_content
    return r.content[0].text


def test_clients_may_not_use_host_directories_unless_allowed(store, image, daemon, tmp_path, other_root):
    other_dir, other_snapshot = other_root
    tf, token = _token_file(tmp_path)
    with http_server(tmp_path, "--store", str(store.root), "--image", image, "--token-file", str(tf),
                     env=daemon) as (url, _):
        async def main():
            async with _authed(url, token) as client:
                for ref in ("dir:/", other_dir, other_snapshot):   # the host's root, a root directory, one built on it
                    text = await _create_error(client, {"image": ref})
                    assert "--allow-host-dirs" in text and "directory of the MCP server's host" in text, text
                for args in ({}, {"image": image}):   # the operator's --image is the operator's choice
                    r = await client.call_tool("sandbox_create", {"timeout": 60, **args})
                    assert not r.is_error, r.content
                    await client.call_tool("sandbox_terminate",
                                           {"sandbox_id": r.structured_content["result"]["sandbox_id"]})
        anyio.run(main)

    async def stdio():   # the same over stdio
        async with Client(_params(store, image, daemon)) as client:
            assert "--allow-host-dirs" in await _create_error(client, {"image": "dir:/"})
    anyio.run(stdio)

    with http_server(tmp_path, "--token-file", str(tf), "--allow-host-dirs", env=daemon) as (url, _):
        async def allowed():
            async with _authed(url, token) as client:
                r = await client.call_tool("sandbox_create", {"image": other_snapshot, "timeout": 60})
                assert not r.is_error, r.content
                sid = r.structured_content["result"]["sandbox_id"]
                r = await client.call_tool("sandbox_exec", {"sandbox_id": sid, "command": "echo ok"})
                assert r.structured_content["result"]["stdout"] == "ok\n"
                await client.call_tool("sandbox_terminate", {"sandbox_id": sid})
        anyio.run(allowed)


@pytest.fixture(scope="module")
def other_root(daemon, tmp_path_factory):
    """A root directory that is not the server's --image, and an image: built on it (a snapshot)."""
    ref = "dir:" + str(busybox_root(tmp_path_factory.mktemp("bb-other") / "root"))
    from hutch.sandbox import _client

    with hutch.Sandbox.create(image=ref, timeout=60) as sb:
        sb.run("sh", "-c", "echo snap > /home/user/s")
        snap = sb.snapshot_filesystem()
    try:
        yield ref, snap.ref
    finally:   # the snapshot went to the host's image store: take it out again
        _client.default_client().request("DELETE", f"/v1/images/{snap.ref}", params={"force": 1})


def test_tools_act_only_on_this_servers_sandboxes(store, image, daemon, tmp_path):
    outside = hutch.Sandbox.create(image=image, timeout=60, tags={"t": "mcp-outside"}, name=f"outside-{os.getpid()}")
    try:
        async def main():
            async with Client(_params(store, image, daemon)) as client:
                for tool, args in (("sandbox_exec", {"command": "id"}), ("sandbox_read_file", {"path": "/etc/passwd"}),
                                   ("sandbox_write_file", {"path": "/tmp/x", "content": "x"}),
                                   ("sandbox_terminate", {})):
                    for ref in (outside.id, outside.name):
                        r = await client.call_tool(tool, {"sandbox_id": ref, **args})
                        assert r.is_error and "not a sandbox of this MCP server" in r.content[0].text, r.content
                r = await client.call_tool("sandbox_list", {"tags": {"t": "mcp-outside"}})
                assert r.structured_content["result"]["sandboxes"] == []
        anyio.run(main)
        assert outside.poll() is None   # untouched
    finally:
        outside.terminate()
