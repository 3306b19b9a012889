"""The code interpreter's bridge: runs INSIDE a sandbox, between the SDK and Jupyter kernels there.

The SDK starts it with `sb.exec("python3", "-I", "-c", <this file's source>)`, so it has every
restriction of the sandbox by construction, and speaks line-delimited JSON with it over that exec's
stdin and stdout. The bridge starts one ipykernel per context and speaks the Jupyter protocol to each
with jupyter_client's Session over ZMQ sockets on the sandbox's own filesystem (ipc transport: no port,
nothing on any network, the sandbox's egress policy untouched).

Requests (one JSON object a line, each with an "id" chosen by the SDK):
    {"op": "execute", "id", "context", "code", "timeout"}      timeout: seconds or null
    {"op": "interrupt", "context"}                               SIGINT to the context's kernel
    {"op": "create_context", "id", "cwd"}    {"op": "remove_context", "id", "context"}
    {"op": "shutdown"}                                           (so does end-of-file)
Answers, streamed as they come (each with the request's "id"):
    {"kind": "stdout"|"stderr", "text"}    {"kind": "result", "data": {mime: value}, "main": bool}
    {"kind": "error", "name", "value", "traceback"}    {"kind": "context", "context": {...}}
    {"kind": "done", "execution_count", "restarted", "dropped": {...}}    {"kind": "fail", "error", "message"}
and once, unprompted: {"kind": "ready", "protocol": PROTOCOL} or {"kind": "fatal", "error", "message"}.

What one cell sends back is bounded (CELL_* below); the rest is dropped and counted in "dropped".
This module must run on the image's python3 with only the stdlib, pyzmq and jupyter_client: it imports
nothing of hutch.
"""

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time

PROTOCOL = 1
CELL_STREAM = 1 << 20          # characters of stdout, and of stderr, one cell sends back
CELL_RESULTS = 8 << 20         # characters of result data (base64 for images) one cell sends back
CELL_ERROR = 64 << 10          # characters of an error's value, and of its traceback
MAX_CONTEXTS = 16              # kernels one bridge runs at once
INTERRUPT_GRACE = 3.0          # seconds a timed-out cell has to stop after SIGINT before its kernel is killed
READY_TIMEOUT = 60.0           # seconds a kernel has to answer kernel_info once started
IDLE_WAIT = 2.0                # seconds to wait for the idle status after the reply (iopub may lag)
STDERR_TAIL = 4096             # bytes of a kernel's own stderr kept to explain its death
DEFAULT = "default"
# numpy 2 shows a scalar as np.int64(10); an agent asked for a sum wants 10, as numpy 1 and print() show it.
# Registered by (exact) class name, so that numpy is imported only by the cells that use it.
_SCALARS = ("_f = get_ipython().display_formatter.formatters['text/plain']\n"
            "for _t in ('bool int8 int16 int32 int64 longlong uint8 uint16 uint32 uint64 ulonglong float16 float32 "
            "float64 longdouble complex64 complex128 clongdouble').split():\n"
            "    _f.for_type_by_name('numpy', _t, lambda o, p, c: p.text(str(o)))\n"
            "del _f, _t")


def _send(obj) -> None:
    sys.stdout.buffer.write(json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "replace")
                            + b"\n")
    sys.stdout.buffer.flush()


def _not_dumpable() -> None:
    # Code in the kernels runs as this bridge's user: without this it could open /proc/<bridge>/fd/1 and
    # write lines into the protocol. Non-dumpable, /proc/<pid>/fd needs CAP_SYS_PTRACE, which nothing here has.
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)   # PR_SET_DUMPABLE
    except Exception:
        pass


def _clip(text, limit):
    text = "" if text is None else str(text)
    return text if len(text) <= limit else text[:limit] + f"\n... [{len(text) - limit:,} characters cut]"


def _died(status) -> str:
    if status is None:
        return "ended"
    if status < 0:
        name = signal.Signals(-status).name if -status in signal.Signals._value2member_map_ else str(-status)
        hint = " (most often the sandbox's memory limit: the kernel's out-of-memory killer)" if status == -9 else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {status}"


class Cell:
    """One execute request on its way through a kernel."""

    def __init__(self, rid, code, timeout):
        self.rid, self.code = rid, code
        self.timeout = timeout
        self.msg_id = None
        self.deadline = None          # monotonic time of the interrupt
        self.kill_at = None           # monotonic time the kernel is killed if the interrupt did not stop it
        self.timed_out = False
        self.reply = None             # the execute_reply content
        self.idle_by = None           # give up waiting for iopub's idle at this time once the reply is in
        self.idle = False
        self.restarted = False        # the kernel of its context had died since the last cell
        self.killed = False           # its kernel was killed for not stopping at the interrupt (reported)
        self.interrupted_tb = ""      # where the interrupt of a timed-out cell caught it
        self.left = {"stdout": CELL_STREAM, "stderr": CELL_STREAM, "results": CELL_RESULTS}
        self.dropped = {"stdout": 0, "stderr": 0, "results": 0}

    def stream(self, name, text):
        room = self.left[name]
        if len(text) > room:
            self.dropped[name] += len(text) - room
            text = text[:room]
        self.left[name] -= len(text)
        if text:
            _send({"id": self.rid, "kind": name, "text": text})

    def result(self, data, main):
        bundle, size = {}, 0
        for mime, value in data.items():   # JSON values (application/json) stay JSON; counted as encoded
            bundle[str(mime)] = value
            size += len(value) if isinstance(value, str) else len(json.dumps(value))
        if size > self.left["results"]:   # keep a cut text/plain (a hint of what it was), drop the rest
            text = bundle.get("text/plain", "")[:max(0, min(self.left["results"], 4096))]
            self.dropped["results"] += size - len(text)
            bundle = {"text/plain": text} if text else {}
            size = len(text)
        self.left["results"] -= size
        if bundle:
            _send({"id": self.rid, "kind": "result", "data": bundle, "main": main})

    def error(self, name, value, traceback):
        _send({"id": self.rid, "kind": "error", "name": _clip(name, 256), "value": _clip(value, CELL_ERROR),
               "traceback": _clip(traceback, CELL_ERROR)})

    def done(self, count=None, restarted=False):
        _send({"id": self.rid, "kind": "done", "execution_count": count, "restarted": restarted,
               "dropped": self.dropped})


class Kernel:
    """One context: an ipykernel process, its ZMQ sockets, and the cells queued for it."""

    def __init__(self, bridge, cid, cwd):
        self.bridge, self.id, self.cwd = bridge, cid, cwd
        self.proc = self.pidfd = None
        self.queue, self.cell = [], None
        self.ready = False
        self.info_id = None           # the kernel_info request that checks both channels are connected
        self.iopub_seen = False
        self.lost_state = False       # a kernel of this context died: the next cell says so
        self.started_at = 0.0
        self.ever_ready = False
        self.stderr_tail = b""
        self.shell = self.iopub = None
        self.start()

    # --- process --------------------------------------------------------------------------------

    def start(self):
        d = tempfile.mkdtemp(prefix=f"hutch-kernel-{self.id}-")
        self.dir = d
        self.key = secrets.token_hex(16)
        conn = {"transport": "ipc", "ip": os.path.join(d, "k"), "shell_port": 1, "iopub_port": 2,
                "stdin_port": 3, "control_port": 4, "hb_port": 5, "key": self.key,
                "signature_scheme": "hmac-sha256", "kernel_name": "python3"}
        with open(os.path.join(d, "connection.json"), "w") as f:
            json.dump(conn, f)
        env = dict(os.environ, JPY_PARENT_PID=str(os.getpid()), PYDEVD_DISABLE_FILE_VALIDATION="1")
        # the kernel's own stdout and stderr never reach the protocol: ipykernel captures the cell's output
        # at the descriptor level and sends it over iopub; its stderr (its own crashes) comes to a pipe here
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ipykernel_launcher", "-f", os.path.join(d, "connection.json"),
             "--HistoryManager.hist_file=:memory:", "--IPKernelApp.quiet=True",
             "--InteractiveShell.colors=nocolor",   # tracebacks for people and models, not terminals
             "--IPKernelApp.exec_lines=" + _SCALARS],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=self.cwd, env=env,
            start_new_session=True)   # its own process group: an interrupt reaches what the cell started too
        os.set_blocking(self.proc.stderr.fileno(), False)
        self.pidfd = os.pidfd_open(self.proc.pid)
        self.started_at = time.monotonic()
        self.ready, self.info_id, self.iopub_seen = False, None, False
        if self.bridge.zmq is not None:
            self.connect()

    def connect(self):
        zmq = self.bridge.zmq
        ctx = self.bridge.ctx
        base = os.path.join(self.dir, "k")
        self.shell, self.iopub = ctx.socket(zmq.DEALER), ctx.socket(zmq.SUB)
        for sock in (self.shell, self.iopub):
            sock.linger = 0
            # the kernel binds its sockets ~0.3 s after it starts; ZMQ retries a refused connect after
            # RECONNECT_IVL (100 ms by default), which would add up to that much to a cold start
            sock.setsockopt(zmq.RECONNECT_IVL, 5)
        self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
        self.shell.connect(f"ipc://{base}-1")
        self.iopub.connect(f"ipc://{base}-2")
        self.session = self.bridge.Session(key=self.key.encode(), signature_scheme="hmac-sha256",
                                           username="hutch")
        self.bridge.watch(self)
        self.ask_info()

    def ask_info(self):
        self.info_id = self.session.send(self.shell, "kernel_info_request", {})["header"]["msg_id"]
        self.info_at = time.monotonic()

    def signal(self, sig):
        try:
            os.killpg(self.proc.pid, sig)
        except OSError:
            try:
                self.proc.send_signal(sig)
            except OSError:
                pass

    def stop(self):
        self.bridge.unwatch(self)
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGKILL)
            self.proc.wait()
        for s in (self.shell, self.iopub):
            if s is not None:
                s.close(0)
        self.shell = self.iopub = None
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        if self.proc is not None:
            self.proc.stderr.close()
        try:
            for name in os.listdir(self.dir):
                os.unlink(os.path.join(self.dir, name))
            os.rmdir(self.dir)
        except OSError:
            pass

    def read_stderr(self):
        try:
            data = self.proc.stderr.read()
        except OSError:
            data = None
        if data:
            self.stderr_tail = (self.stderr_tail + data)[-STDERR_TAIL:]
        return data

    def exited(self):
        """The kernel's process ended: report it to the cell it ran, restart, and tell the next cell."""
        self.read_stderr()
        status = self.proc.wait()
        cell, was_ready = self.cell, self.ever_ready
        tail = self.stderr_tail.decode("utf-8", "replace").strip()
        self.stop()
        self.cell = None
        if not was_ready:   # it never came up: starting it again would fail the same way
            why = f"the kernel {_died(status)} before it was ready" + (f"; its stderr ends with:\n{tail}" if tail else "")
            for c in ([cell] if cell else []) + self.queue:
                _send({"id": c.rid, "kind": "fail", "error": "SandboxError", "message": why})
            self.queue = []
            self.broken = why
            return
        if cell is not None and cell.killed:
            cell.done(None, restarted=False)
        elif cell is not None:
            cell.error("KernelDied", f"the kernel {_died(status)} while running this cell; its state (variables, "
                       "imports) was lost, and the next cell runs in a fresh kernel", tail)
            cell.done(None, restarted=False)
        self.lost_state = True
        self.ever_ready = False
        self.stderr_tail = b""
        self.start()

    # --- cells ----------------------------------------------------------------------------------

    def submit(self, cell):
        self.queue.append(cell)
        self.next()

    def next(self):
        if self.cell is not None or not self.ready or not self.queue:
            return
        cell = self.cell = self.queue.pop(0)
        content = {"code": cell.code, "silent": False, "store_history": True, "user_expressions": {},
                   "allow_stdin": False, "stop_on_error": False}
        cell.msg_id = self.session.send(self.shell, "execute_request", content)["header"]["msg_id"]
        if cell.timeout is not None:
            cell.deadline = time.monotonic() + cell.timeout

    def finish(self):
        cell, self.cell = self.cell, None
        reply = cell.reply or {}
        if cell.timed_out:
            cell.error("TimeoutError", f"the cell ran past timeout={cell.timeout:g} s and was interrupted; the kernel "
                       "and its state are kept", cell.interrupted_tb)
        cell.done(reply.get("execution_count"), restarted=cell.restarted)
        self.next()

    def on_shell(self):
        while True:
            _, msg = self.session.recv(self.shell, mode=self.bridge.zmq.NOBLOCK)
            if msg is None:
                return
            parent = msg.get("parent_header", {}).get("msg_id")
            kind = msg["header"]["msg_type"]
            if kind == "kernel_info_reply" and parent == self.info_id:
                self.on_iopub()   # its busy status may be queued there already
                if self.iopub_seen:
                    self.became_ready()
                else:   # iopub is not connected yet (its messages would be lost): ask again
                    self.ask_info()
            elif kind == "execute_reply" and self.cell is not None and parent == self.cell.msg_id:
                self.cell.reply = msg["content"]
                self.cell.idle_by = time.monotonic() + IDLE_WAIT
                if self.cell.idle:
                    self.finish()

    def became_ready(self):
        self.ready = self.ever_ready = True
        self.info_id = None
        self.next()

    def on_iopub(self):
        while True:
            _, msg = self.session.recv(self.iopub, mode=self.bridge.zmq.NOBLOCK)
            if msg is None:
                return
            self.iopub_seen = True
            cell = self.cell
            if cell is None or msg.get("parent_header", {}).get("msg_id") != cell.msg_id:
                continue   # another request's (kernel_info), or what a background thread printed after its cell
            kind, c = msg["header"]["msg_type"], msg["content"]
            if kind == "stream":
                cell.stream("stderr" if c.get("name") == "stderr" else "stdout", c.get("text", ""))
            elif kind in ("execute_result", "display_data"):
                cell.result(c.get("data") or {}, kind == "execute_result")
            elif kind == "error":
                tb = "\n".join(str(t) for t in c.get("traceback") or ())
                if cell.timed_out:   # the interrupt's KeyboardInterrupt: reported as the timeout once the cell ends
                    cell.interrupted_tb = tb
                else:
                    cell.error(c.get("ename", ""), c.get("evalue", ""), tb)
            elif kind == "status" and c.get("execution_state") == "idle":
                cell.idle = True
                if cell.reply is not None:
                    self.finish()

    def tick(self, now):
        """Timers: a cell's timeout (interrupt), its grace (kill), a kernel slow to come up, a lagging idle."""
        cell = self.cell
        if cell is not None:
            if cell.deadline is not None and now >= cell.deadline and not cell.timed_out:
                cell.timed_out = True
                cell.kill_at = now + INTERRUPT_GRACE
                self.signal(signal.SIGINT)
            elif cell.kill_at is not None and now >= cell.kill_at and cell.reply is None:
                cell.error("TimeoutError", f"the cell ran past timeout={cell.timeout:g} s and did not stop within "
                           f"{INTERRUPT_GRACE:g} s of the interrupt, so its kernel was restarted: its state "
                           "(variables, imports) was lost", "")
                cell.timed_out, cell.killed, cell.kill_at = False, True, None
                self.signal(signal.SIGKILL)   # exited() ends the cell once the process is gone
            elif cell.idle_by is not None and now >= cell.idle_by:
                self.finish()
        if not self.ready and self.info_id is not None:
            if now - self.started_at > READY_TIMEOUT:
                self.signal(signal.SIGKILL)
            elif now - self.info_at > 0.5:
                self.ask_info()

    def timers(self):
        c = self.cell
        out = [self.info_at + 0.5] if not self.ready and self.info_id is not None else []
        if c is not None:
            out += [t for t in (c.deadline if not c.timed_out else None, c.kill_at, c.idle_by) if t is not None]
        return out


class Bridge:
    def __init__(self):
        self.zmq = self.ctx = self.Session = None
        self.kernels = {}
        self.fds = {}   # fd -> (kernel, what)
        self.inbuf = b""

    def main(self):
        _not_dumpable()
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # a Ctrl-C meant for a cell is the kernel's, never ours
        cwd = os.getcwd()
        first = Kernel(self, DEFAULT, cwd)   # starts while jupyter_client is imported: the two overlap
        self.kernels[DEFAULT] = first
        try:
            import zmq
            from jupyter_client.session import Session
        except ImportError as e:
            first.stop()
            _send({"kind": "fatal", "error": "ImageError",
                   "message": f"this sandbox's image cannot run the code interpreter ({e}); create the sandbox with "
                              "image=hutch.Image.code_interpreter(), or add .pip_install('ipykernel', "
                              "'jupyter_client') to your image."})
            return 1
        self.zmq, self.Session, self.ctx = zmq, Session, zmq.Context()
        self.poller = zmq.Poller()
        self.poller.register(0, zmq.POLLIN)
        os.set_blocking(0, False)
        first.connect()
        _send({"kind": "ready", "protocol": PROTOCOL, "pid": os.getpid()})
        try:
            self.loop()
        except Exception:   # say why before going: the SDK reads no stderr of the bridge
            import traceback

            _send({"kind": "fatal", "error": "SandboxError", "message": "the code interpreter's bridge failed: "
                   + traceback.format_exc()[-4000:]})
            return 1
        finally:
            for k in list(self.kernels.values()):
                k.stop()
        return 0

    def watch(self, k):
        for sock, what in ((k.shell, "shell"), (k.iopub, "iopub")):
            self.poller.register(sock, self.zmq.POLLIN)
        for fd, what in ((k.pidfd, "exit"), (k.proc.stderr.fileno(), "stderr")):
            self.poller.register(fd, self.zmq.POLLIN)
            self.fds[fd] = (k, what)

    def unwatch(self, k):
        if self.zmq is None:
            return
        for s in (k.shell, k.iopub):
            if s is not None:
                try:
                    self.poller.unregister(s)
                except KeyError:
                    pass
        for fd in [fd for fd, (kk, _) in self.fds.items() if kk is k]:
            self.poller.unregister(fd)
            del self.fds[fd]

    def loop(self):
        while True:
            timers = [t for k in self.kernels.values() for t in k.timers()]
            wait = None if not timers else max(0, int((min(timers) - time.monotonic()) * 1000) + 1)
            events = dict(self.poller.poll(wait))
            if 0 in events and not self.read_requests():
                return
            for k in list(self.kernels.values()):   # iopub first: a reply's outputs come before it
                if k.iopub is not None and k.iopub in events:
                    k.on_iopub()
                if k.shell is not None and k.shell in events:
                    k.on_shell()
            for fd in [fd for fd in events if fd in self.fds]:
                if fd not in self.fds:
                    continue
                k, what = self.fds[fd]
                if what == "stderr":
                    if k.read_stderr() == b"":   # its end closed: the exit follows on the pidfd
                        self.poller.unregister(fd)
                        del self.fds[fd]
                else:
                    k.exited()
            now = time.monotonic()
            for k in list(self.kernels.values()):
                k.tick(now)

    def read_requests(self) -> bool:
        try:
            data = os.read(0, 1 << 20)
        except BlockingIOError:
            return True
        if not data:
            return False
        self.inbuf += data
        while b"\n" in self.inbuf:
            line, self.inbuf = self.inbuf.split(b"\n", 1)
            if line.strip():
                if self.request(json.loads(line)) is False:
                    return False
        return True

    def request(self, req):
        op, rid = req.get("op"), req.get("id")
        if op == "shutdown":
            return False
        if op == "create_context":
            return self.create(rid, req.get("cwd"))
        k = self.kernels.get(req.get("context") or DEFAULT)
        if k is None:
            _send({"id": rid, "kind": "fail", "error": "NotFoundError",
                   "message": f"no code context {req.get('context')!r} in this sandbox (removed, or never made); "
                              "make one with create_code_context() or list them with list_code_contexts()."})
            return True
        if op == "interrupt":
            if k.cell is not None:
                k.signal(signal.SIGINT)
        elif op == "remove_context":
            k.stop()
            del self.kernels[k.id]
            _send({"id": rid, "kind": "ok"})
        elif op == "execute":
            if getattr(k, "broken", None):   # its kernel could not start: try once more for this cell
                k.broken = None
                k.start()
            cell = Cell(rid, req["code"], req.get("timeout"))
            cell.restarted, k.lost_state = k.lost_state, False
            k.submit(cell)
        return True

    def create(self, rid, cwd):
        if len(self.kernels) >= MAX_CONTEXTS:
            _send({"id": rid, "kind": "fail", "error": "StateError",
                   "message": f"this sandbox already runs {MAX_CONTEXTS} code contexts; remove one first."})
            return True
        cwd = cwd or os.getcwd()
        try:
            os.makedirs(cwd, exist_ok=True)
        except OSError as e:
            _send({"id": rid, "kind": "fail", "error": "ConfigError",
                   "message": f"cannot use {cwd!r} as the context's working directory: {e.strerror}."})
            return True
        cid = "ctx-" + secrets.token_hex(4)
        self.kernels[cid] = Kernel(self, cid, cwd)
        _send({"id": rid, "kind": "context", "context": {"id": cid, "cwd": cwd, "language": "python"}})
        return True


if __name__ == "__main__":
    sys.exit(Bridge().main())
