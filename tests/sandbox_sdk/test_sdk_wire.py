"""The SDK's I/O-free pieces: frame decoding, error mapping, argument checking, Image, spec building."""

import json

import pytest

import hutch
from hutch.sandbox import _api
from hutch.sandbox._process import _Output
from hutch.sandbox._ensure import ImageProgress
from hutch.sandbox.sandbox import build_spec


def _frames(*pairs):
    return b"".join(_api.encode_frame(k, p) for k, p in pairs)


def test_frames_split_anywhere_decode_the_same():
    data = _frames((1, b"hello\n"), (2, b"oops"), (1, b""), (3, b'{"returncode": 3, "reason": "exited"}'))
    whole = _api.FrameDecoder().feed(data)
    assert [k for k, _ in whole] == [1, 2, 1, 3]
    for cut in range(1, len(data)):
        d = _api.FrameDecoder()
        assert d.feed(data[:cut]) + d.feed(data[cut:]) == whole
        assert d.pending == 0
    d = _api.FrameDecoder()
    got = [f for b in data for f in d.feed(bytes([b]))]   # one byte at a time
    assert got == whole


def test_output_buffers_lines_and_exit():
    out = _Output()
    out.feed(_frames((1, b"a\nb"), (2, b"err\n")))
    assert out.take_line(1) == b"a\n"
    assert out.take_line(1) is None          # "b" is not a whole line yet and the stream is open
    out.feed(_frames((1, b"c\n"), (3, json.dumps({"returncode": -9, "reason": "timeout"}).encode())))
    out.finish()
    assert out.take_line(1) == b"bc\n"
    assert out.take_line(1) == b""           # end of stream
    assert out.take_all(2) == b"err\n"
    assert out.status() == _api.ExitStatus(-9, "timeout")


def test_output_without_exit_frame_is_a_daemon_error():
    out = _Output()
    out.feed(_frames((1, b"partial")))
    out.finish()
    with pytest.raises(hutch.DaemonError, match="exit status"):
        out.status()


def test_text_decoder_keeps_split_utf8_whole():
    dec = _api.TextStreamDecoder()
    data = "héllo €\n".encode()
    assert "".join(dec.decode(data[i:i + 1]) for i in range(len(data))) + dec.decode(b"", True) == "héllo €\n"


@pytest.mark.parametrize("name,cls", [("StateError", hutch.StateError), ("NotFoundError", hutch.NotFoundError),
                                      ("InvalidSpecError", hutch.InvalidSpecError), ("ImageError", hutch.ImageError),
                                      ("OutOfMemoryError", hutch.OutOfMemoryError)])
def test_error_answers_map_to_their_class(name, cls):
    err = _api.error_from_answer(409, json.dumps({"error": name, "message": "Do the thing."}).encode())
    assert type(err) is cls and str(err) == "Do the thing."


@pytest.mark.parametrize("body", [b"<html>bad gateway</html>", b'{"error": "KeyError", "message": "x"}',
                                  b'{"error": "ValueError", "message": "x"}', b"{}"])
def test_unknown_error_answers_become_daemon_errors(body):
    assert type(_api.error_from_answer(502, body)) is hutch.DaemonError


def test_exec_body_validates_and_builds():
    assert _api.exec_body(["ls", "-l"], timeout=2, workdir="/tmp", env={"A": "1"}, stdin=True) == {
        "argv": ["ls", "-l"], "env": {"A": "1"}, "workdir": "/tmp", "timeout": 2.0, "stdin": True}
    for kw, match in [({"timeout": 0}, "timeout"), ({"workdir": "tmp"}, "absolute"), ({"env": {"A=B": "1"}}, "env")]:
        with pytest.raises(hutch.InvalidSpecError, match=match):
            _api.exec_body(["ls"], **kw)
    with pytest.raises(hutch.InvalidSpecError, match="needs a command"):
        _api.exec_body([])
    with pytest.raises(hutch.InvalidSpecError, match="not a string"):
        _api.exec_body(["ls", 3])


def test_stdin_payload():
    assert _api.stdin_payload(True) == (True, None)
    assert _api.stdin_payload(False) == (False, None)
    assert _api.stdin_payload("hé") == (True, "hé".encode())
    assert _api.stdin_payload(b"\0") == (True, b"\0")
    with pytest.raises(hutch.InvalidSpecError):
        _api.stdin_payload(3)


def test_exec_result_check_raises_exec_error_carrying_the_result():
    ok = _api.ExecResult(("true",), 0, "", "")
    assert ok.check() is ok
    bad = _api.ExecResult(("sh", "-c", "exit 3"), 3, "out", "boom\n")
    with pytest.raises(hutch.ExecError) as ei:
        bad.check()
    e = ei.value
    assert (e.returncode, e.stdout, e.stderr, e.argv) == (3, "out", "boom\n", ("sh", "-c", "exit 3"))
    assert "boom" in str(e) and "check=False" in str(e)


def test_image_values(tmp_path):
    assert hutch.Image.debian_slim().ref == "debian-slim"
    assert hutch.Image.from_directory(tmp_path).ref == f"dir:{tmp_path}"
    assert hutch.Image.of(None) == hutch.Image.debian_slim()
    with pytest.raises(hutch.NotFoundError, match="not a directory"):
        hutch.Image.from_directory(tmp_path / "missing")
    with pytest.raises(hutch.InvalidSpecError):
        hutch.Image.of(3)
    with pytest.raises(Exception):
        hutch.Image.debian_slim().ref = "x"   # frozen


def _spec(**kw):
    base = dict(image=None, mounts=(), cpu=1.0, memory="512M", pids=64, disk="1G", timeout=60, idle_timeout=None,
                workdir="/home/user", env=None, tags=None, name=None, network=None, detach=False)
    base.update(kw)
    return build_spec((), **base)


def test_build_spec_bad_input_names_the_fix(tmp_path):
    with pytest.raises(hutch.InvalidSpecError, match="memory='lots'.*512M"):
        _spec(memory="lots")
    with pytest.raises(hutch.InvalidSpecError, match="does not exist"):
        _spec(mounts=[hutch.Mount.bind(str(tmp_path / "nope"), "/data")])
    s = _spec(image=hutch.Image.from_directory(tmp_path), tags={"a": "b"})
    assert s.image == f"dir:{tmp_path}" and s.tags == (("a", "b"),)
    assert s.to_dict()["limits"]["memory"] == 512 * 1024**2


def test_tag_params():
    assert _api.tag_params({"b": "2", "a": "1"}) == [("tag", "a:1"), ("tag", "b:2")]
    with pytest.raises(hutch.InvalidSpecError):
        _api.tag_params(["a"])


def test_image_progress_reports_and_fails(capsys):
    import io

    buf = io.StringIO()
    p = ImageProgress("debian-slim", buf, quiet_for=0)
    p.line(json.dumps({"phase": "download", "message": "I: Retrieving x", "bytes": 5_000_000, "elapsed": 1.0}))
    p.line("")
    p.line(json.dumps({"done": True, "ref": "debian-slim", "id": "debian-slim-1"}))
    assert p.finish()["id"] == "debian-slim-1"
    assert "building image debian-slim: download" in buf.getvalue() and "ready" in buf.getvalue()
    # debootstrap alternates between phases: a line per new phase, else one per `every` seconds
    few = io.StringIO()
    f = ImageProgress("debian-slim", few, quiet_for=0, every=3600)
    for i in range(200):
        f.line(json.dumps({"phase": ["download", "extract", "install"][i % 3], "message": f"I: {i}", "elapsed": i}))
    assert few.getvalue().count("building image") == 3
    quiet = io.StringIO()
    r = ImageProgress("dir:/x", quiet)   # ready at once: nothing shown
    r.line(json.dumps({"phase": "check", "message": "ok", "bytes": 0, "elapsed": 0.0}))
    r.line(json.dumps({"done": True, "ref": "dir:/x", "id": "dir:/x"}))
    assert quiet.getvalue() == ""
    q = ImageProgress("nope", io.StringIO())
    with pytest.raises(hutch.NotFoundError, match="use it"):
        q.line(json.dumps({"error": "NotFoundError", "message": "image 'nope' is unknown; use it."}))
    with pytest.raises(hutch.ImageError):
        ImageProgress("x", io.StringIO()).finish()


# --- one spec, valid wherever it is built: from_dict checks as build does ---------------------------------

def _valid(tmp_path):
    return dict(
        command=["sh", "-c", "true"], image="debian-slim", network=hutch.Network.allow(domains=["example.com"]),
        mounts=[hutch.Mount.bind(str(tmp_path), "/data", readonly=False, owner=1000), hutch.Mount.tmpfs("/scratch"),
                hutch.Mount.volume("vol-1", "/vol", readonly=True)],
        memory="256M", cpu=0.5, pids=100, disk="2G", timeout=30, idle_timeout=5, workdir="/work",
        env={"A": "1"}, tags={"t": "x"}, name="sb-1", detach=True, capabilities=["CHOWN"])


def test_a_spec_survives_its_json(tmp_path):
    from hutch.sandbox._spec import SandboxSpec

    kw = _valid(tmp_path)
    s = SandboxSpec.build(kw.pop("command"), **kw)
    assert SandboxSpec.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    assert SandboxSpec.from_dict({}) == SandboxSpec.build()


BAD = [   # (field of the JSON, its value, the build() keyword and value that make the same mistake)
    ("command", ["ls", 3], "command", ["ls", 3]),
    ("env", [["A=B", "1"]], "env", {"A=B": "1"}),
    ("tags", [["t", 3]], "tags", {"t": 3}),
    ("capabilities", ["SYS_ADMIN"], "capabilities", ["SYS_ADMIN"]),
    ("name", "no spaces", "name", "no spaces"),
    ("workdir", "relative", "workdir", "relative"),
    ("timeout", -1, "timeout", -1),
    ("idle_timeout", "soon", "idle_timeout", "soon"),
    ("image", "", "image", ""),
    ("limits", {"memory": 0}, "memory", 0),
    ("limits", {"cpu": 0}, "cpu", 0),
    ("limits", {"pids": 0}, "pids", 0),
    ("limits", {"disk": "lots"}, "disk", "lots"),
]


@pytest.mark.parametrize("field,value,kw,kwvalue", BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_from_dict_refuses_what_build_refuses_with_the_same_words(field, value, kw, kwvalue):
    from hutch.sandbox._spec import SandboxSpec

    with pytest.raises(hutch.InvalidSpecError) as built:
        if kw == "command":
            SandboxSpec.build(kwvalue)
        else:
            SandboxSpec.build(**{kw: kwvalue})
    with pytest.raises(hutch.InvalidSpecError) as sent:
        SandboxSpec.from_dict({field: value})
    assert str(sent.value) == str(built.value)


@pytest.mark.parametrize("mount,words", [
    ({"kind": "tmpfs", "target": "/t", "size": 0}, "must be positive"),
    ({"kind": "tmpfs", "target": "t", "size": 1024}, "absolute path"),
    ({"kind": "tmpfs", "target": "/t", "size": 1024, "readonly": True}, "takes no readonly"),
    ({"kind": "bind", "source": "/nonexistent-hutch", "target": "/b"}, "does not exist"),
    ({"kind": "bind", "source": "relative", "target": "/b"}, "absolute host path"),
    ({"kind": "bind", "source": "/", "target": "/b", "readonly": True, "owner": [1000, 1000]}, "needs readonly=False"),
    ({"kind": "bind", "source": "/", "target": "/b", "readonly": False, "owner": [-1, 0]}, "host uid"),
    ({"kind": "volume", "source": "../etc", "target": "/v"}, "not a volume name"),
    ({"kind": "overlay", "target": "/o"}, "malformed"),
    ({"kind": "tmpfs", "target": "/t", "size": 1024, "propagation": "shared"}, "malformed"),
    ("/data", "malformed"),
])
def test_from_dict_checks_each_mount_as_its_constructor_does(mount, words):
    from hutch.sandbox._spec import SandboxSpec

    with pytest.raises(hutch.InvalidSpecError, match=words):
        SandboxSpec.from_dict({"mounts": [mount]})


def test_from_dict_refuses_two_mounts_on_one_target_and_shapes_it_cannot_read():
    from hutch.sandbox._spec import SandboxSpec

    t = {"kind": "tmpfs", "target": "/t", "size": 1024}
    with pytest.raises(hutch.InvalidSpecError, match="share a target"):
        SandboxSpec.from_dict({"mounts": [t, t]})
    for bad in ({"command": "ls -l"}, {"limits": 5}, {"env": {"A": "1"}}, {"mounts": {"a": 1}}, []):
        with pytest.raises(hutch.InvalidSpecError):
            SandboxSpec.from_dict(bad)


def test_an_image_is_ensured_once_per_daemon_unless_told_not_to_remember(tmp_path):
    from hutch.sandbox._client import Endpoint
    from hutch.sandbox._ensure import Ensure

    here, there = Endpoint(socket_path=str(tmp_path / "a.sock")), Endpoint(socket_path=str(tmp_path / "b.sock"))
    first = Ensure(here, "img-x")
    assert first.needed and first.body == {"ref": "img-x"}
    first.feed(b'{"phase": "pull", "message": "x"}')
    first.feed(b'{"done": true, "ref": "img-x", "id": "abc"}')
    assert first.done()["id"] == "abc"
    assert not Ensure(here, "img-x").needed and Ensure(there, "img-x").needed and Ensure(here, "img-y").needed
    assert Ensure(here, "img-x", remember=False).needed   # the builder asks for the base's id every time
    unremembered = Ensure(there, "img-z", remember=False)
    unremembered.feed('{"done": true, "ref": "img-z", "id": "z"}')
    unremembered.done()
    assert Ensure(there, "img-z").needed
    failed = Ensure(there, "img-w")
    with pytest.raises(hutch.ImageError):
        failed.feed('{"error": "ImageError", "message": "no"}')
    assert Ensure(there, "img-w").needed
