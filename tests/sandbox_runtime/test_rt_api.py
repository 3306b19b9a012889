"""The HTTP API itself: the OpenAPI document, the files calls, and bad input mapped to hutch errors."""

from __future__ import annotations

import re
from pathlib import Path

from rt_support import REPO


def test_openapi_lists_every_route_and_matches_docs(api):
    doc = api.http.get("/v1/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    served = {(m.lower(), p) for p, ops in doc["paths"].items() for m in ops}
    from hutch.sandbox._host.daemon.manager import Manager
    from hutch.sandbox._host.daemon.server import make_app

    app = make_app(Manager.__new__(Manager))
    routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    assert routes == served, f"routes missing from the document: {routes - served}; extra: {served - routes}"
    text = (REPO / "docs" / "api.md").read_text()
    documented = set(re.findall(r"`(GET|POST|PUT|DELETE) (/v1/[^` ]+)`", text))
    documented = {(m.lower(), p.split("?")[0]) for m, p in documented}
    assert documented == served, f"docs/api.md and the daemon differ: {documented ^ served}"


def test_files_roundtrip(api, image):
    sid = api.create(image)["id"]
    base = f"/v1/sandboxes/{sid}/files"
    data = bytes(range(256)) * 4096  # 1 MiB, every byte value
    assert api.http.put(f"{base}/write", params={"path": "/home/user/sub/blob.bin", "mode": "0600"},
                        content=data).status_code == 204
    assert api.http.get(f"{base}/read", params={"path": "/home/user/sub/blob.bin"}).content == data
    st = api.http.get(f"{base}/stat", params={"path": "/home/user/sub/blob.bin"}).json()
    assert st["type"] == "file" and st["size"] == len(data) and st["mode"] == 0o600
    assert api.http.put(f"{base}/write", params={"path": "rel.txt"}, content=b"r").status_code == 204
    assert api.sh(sid, "cat /home/user/rel.txt")[0] == "r"  # relative paths start at the workdir
    assert api.http.post(f"{base}/mkdir", params={"path": "/home/user/a/b/c", "parents": 1}).status_code == 204
    entries = api.http.get(f"{base}/list", params={"path": "/home/user"}).json()["entries"]
    assert [(e["name"], e["type"]) for e in entries] == [("a", "dir"), ("rel.txt", "file"), ("sub", "dir")]
    r = api.http.post(f"{base}/remove", params={"path": "/home/user/a"})
    assert r.status_code == 400 and r.json()["error"] == "ConfigError" and "recursive" in r.json()["message"]
    assert api.http.post(f"{base}/remove", params={"path": "/home/user/a", "recursive": 1}).status_code == 204
    r = api.http.get(f"{base}/stat", params={"path": "/home/user/a"})
    assert r.status_code == 404 and r.json()["error"] == "NotFoundError"
    r = api.http.get(f"{base}/read", params={"path": "/home/user"})
    assert r.status_code == 400 and r.json()["error"] == "ConfigError"
    r = api.http.get(f"{base}/read", params={"path": "/dev/zero"})  # never streams a device forever
    assert r.status_code == 400


def test_recursive_remove_never_follows_symlinks(api, image):
    sid = api.create(image)["id"]
    out, err, res = api.sh(sid, "mkdir -p /home/user/keep/in /home/user/gone/d/e && echo k > /home/user/keep/in/f && "
                                "echo x > /home/user/gone/d/e/f && ln -s /home/user/keep /home/user/gone/d/dirlink && "
                                "ln -s /home/user/keep/in/f /home/user/gone/filelink && ln -s /nowhere /home/user/gone/dangling")
    assert res["returncode"] == 0, err
    r = api.http.post(f"/v1/sandboxes/{sid}/files/remove", params={"path": "/home/user/gone", "recursive": 1})
    assert r.status_code == 204, r.text
    out, err, res = api.sh(sid, "test ! -e /home/user/gone && cat /home/user/keep/in/f")
    assert (res["returncode"], out) == (0, "k\n"), err   # the links went, what they point at stayed


def test_bad_input_gets_hutch_errors(api, image, tmp_path):
    code, body = api.create_error("dir:/no/such/root")
    assert (code, body["error"]) == (404, "NotFoundError") and "from_directory" in body["message"]
    code, body = api.create_error(image, limits={"memory": "lots"})
    assert body["error"] == "InvalidSpecError" and "memory" in body["message"]
    code, body = api.create_error(image, mounts=[{"kind": "bind", "source": str(tmp_path / "missing"),
                                                  "target": "/data", "readonly": True, "size": None}])
    assert body["error"] == "InvalidSpecError" and "does not exist" in body["message"]
    code, body = api.create_error(image, mounts=[{"kind": "bind", "source": str(tmp_path), "target": "/a/../../etc",
                                                  "readonly": True, "size": None}])
    assert body["error"] == "InvalidSpecError"
    r = api.http.post("/v1/sandboxes", json={"spec": {"image": image, "detach": True,
                                                      "network": {"mode": "allow", "domains": ["Bad Name"]}}})
    if r.status_code == 201:
        api.terminate(r.json()["id"])
    assert r.status_code == 400 and r.json()["error"] == "NetworkPolicyError", r.text
    r = api.http.get("/v1/sandboxes/nope")
    assert r.status_code == 404 and r.json()["error"] == "NotFoundError"
    sid = api.create(image)["id"]
    r = api.http.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["no-such-program"]})
    assert r.status_code == 404 and "not found" in r.json()["message"]
    r = api.http.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"], "workdir": "/no/such/dir"})
    assert r.status_code == 404 and "working directory" in r.json()["message"]
    r = api.http.post(f"/v1/sandboxes/{sid}/exec", json={"argv": "true"})
    assert r.status_code == 400 and r.json()["error"] == "ConfigError"
    api.terminate(sid)
    r = api.http.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"]})
    assert r.status_code == 409 and r.json()["error"] == "StateError" and "create a new sandbox" in r.json()["message"]
    r = api.http.get(f"/v1/sandboxes/{sid}/files/read", params={"path": "/etc/marker"})
    assert r.json()["error"] == "StateError"
    r = api.http.get("/v1/no-such-route")
    assert r.status_code == 404 and r.json()["error"] == "NotFoundError"


def test_env_workdir_and_hostname(api, image):
    sid = api.create(image, env=[["A", "1"], ["B", "2"]], name="envbox", workdir="/srv/app")["id"]
    out, _, _ = api.exec(sid, "sh", "-c", "echo $A $B $C; pwd; hostname", env={"B": "3", "C": "4"})
    assert out.decode().split("\n")[:3] == ["1 3 4", "/srv/app", "envbox"]


def test_docs_name_the_daemon_entry_point():
    text = (REPO / "docs" / "api.md").read_text()
    assert "serve(socket_path=None, listen=None, token=None, *, token_file=None, group=None" in text
    assert Path(REPO / "hutch" / "sandbox" / "_host" / "daemon" / "__init__.py").exists()


def test_images_listed_and_ensured(api, image, tmp_path, monkeypatch):
    r = api.http.post("/v1/images/ensure", json={"ref": image})
    events = [__import__("json").loads(line) for line in r.text.splitlines()]
    assert events[-1] == {"done": True, "ref": image, "id": image}
    r = api.http.post("/v1/images/ensure", json={"ref": "no-such-image"})
    assert r.text.splitlines()[-1].startswith('{"error": "NotFoundError"')
    got = api.http.get("/v1/images").json()["images"]
    assert isinstance(got, list) and all({"ref", "id", "size", "created_at"} <= set(i) for i in got)
    # what the listing reads: each built image's image.json under the state directory
    from hutch.sandbox._host.daemon.server import _built_images

    monkeypatch.setenv("HUTCH_STATE_DIR", str(tmp_path))
    (tmp_path / "images" / "debian-slim").mkdir(parents=True)
    (tmp_path / "images" / "debian-slim" / "image.json").write_text(
        '{"ref": "debian-slim", "id": "debian-slim-bookworm-1", "size": 123, "created_at": 1.5, "suite": "x"}')
    assert _built_images() == [{"ref": "debian-slim", "id": "debian-slim-bookworm-1", "size": 123, "created_at": 1.5}]
