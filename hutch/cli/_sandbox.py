"""`hutch run`, `hutch sandbox create|exec|ls|kill|netlog`, `hutch serve`: thin wrappers over hutch.Sandbox."""

from __future__ import annotations

import json
import os
import re
import sys
import threading

import click

from hutch._core import settings



def _pairs(values, what: str) -> dict[str, str]:
    out = {}
    for v in values:
        k, sep, val = v.partition("=")
        if not sep or not k:
            raise click.BadParameter(f"{v!r} is not K=V", param_hint=what)
        out[k] = val
    return out


def _image(value: str | None):
    import hutch

    if value is None:
        return None
    if os.path.isdir(value):   # a path to a prepared root
        return hutch.Image.from_directory(value)
    return hutch.Image.of(value)


def _mounts(values) -> list:
    import hutch

    out = []
    for v in values:
        parts = v.split(":")
        if len(parts) not in (2, 3, 4) or (len(parts) >= 3 and parts[2] not in ("ro", "rw")) or (
                len(parts) == 4 and (parts[2] != "rw" or not re.fullmatch(r"root|\d+(,\d+)?", parts[3]))):
            raise click.BadParameter(f"{v!r} is not SRC:DST, SRC:DST:rw or SRC:DST:rw:OWNER (OWNER: a host uid, "
                                     "UID,GID, or root)", param_hint="--mount")
        owner = None
        if len(parts) == 4:
            owner = "root" if parts[3] == "root" else tuple(int(i) for i in parts[3].split(","))
            owner = owner[0] if isinstance(owner, tuple) and len(owner) == 1 else owner
        out.append(hutch.Mount.bind(parts[0], parts[1], readonly=not (len(parts) >= 3 and parts[2] == "rw"),
                                    owner=owner))
    return out


def _network(domains, cidrs):
    import hutch

    if not domains and not cidrs:
        return hutch.Network.none()
    return hutch.Network.allow(domains=list(domains), cidrs=list(cidrs))


def sandbox_options(f):
    opts = [
        click.option("--image", help="Image: 'debian-slim' (default), an image reference, or a root directory."),
        click.option("--memory", default="512M", show_default=True, help="Memory limit, like 512M or 2G."),
        click.option("--cpu", type=float, default=1.0, show_default=True, help="CPUs, like 0.5 or 2."),
        click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds the sandbox may live."),
        click.option("--env", "-e", multiple=True, metavar="K=V", help="An environment variable (repeatable)."),
        click.option("--mount", "-v", multiple=True, metavar="SRC:DST[:rw[:OWNER]]",
                     help="Bind a host path, read-only unless ':rw' (repeatable). What the sandbox writes there is "
                          "owned by an unprivileged uid of its own, or by OWNER (a host uid, UID,GID, or root)."),
        click.option("--allow-domain", multiple=True, metavar="NAME",
                     help="Allow egress to this DNS name or '*.domain' (repeatable). Default: no network."),
        click.option("--allow-cidr", multiple=True, metavar="CIDR", help="Allow egress to this IPv4 range (repeatable)."),
        click.option("--workdir", "-w", default="/home/user", show_default=True, help="Working directory inside."),
        click.option("--runtime", type=click.Choice(["native", "gvisor"]), default="native", show_default=True,
                     help="Where it runs: the host kernel's namespaces, or gVisor (runsc; memory snapshots, fork)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def create_kwargs(image, memory, cpu, timeout, env, mount, allow_domain, allow_cidr, workdir, runtime="native") -> dict:
    return dict(image=_image(image), memory=memory, cpu=cpu, timeout=timeout, env=_pairs(env, "--env"),
                mounts=_mounts(mount), network=_network(allow_domain, allow_cidr), workdir=workdir, runtime=runtime)


def file_kwargs(path: str, opts: dict, command=(), **more) -> tuple[tuple, dict]:
    """A sandbox file's (command, create() arguments) with the options given on the command line over it:
    a flag replaces the file's value; --env, --mount, --allow-domain and --allow-cidr add to the file's."""
    import hutch

    ctx = click.get_current_context()
    given = {k for k in opts if ctx.get_parameter_source(k) not in (click.core.ParameterSource.DEFAULT, None)}
    file_command, kw = hutch.SandboxFile.load(path).create_kwargs()
    ours = create_kwargs(**opts)
    for k in given & {"image", "memory", "cpu", "timeout", "workdir", "runtime"}:
        kw[k] = ours[k]
    kw["env"] = {**kw["env"], **ours["env"]}
    kw["mounts"] = list(kw["mounts"]) + list(ours["mounts"])
    if opts["allow_domain"] or opts["allow_cidr"]:
        net = kw["network"]
        if net.mode == "open":
            raise click.UsageError("the file's network is open; --allow-domain/--allow-cidr would narrow it: "
                                   "edit the file's [network] instead.")
        kw["network"] = hutch.Network.allow(domains=list(net.domains) + list(opts["allow_domain"]),
                                            cidrs=list(net.cidrs) + list(opts["allow_cidr"]),
                                            ports=list(net.ports) if net.mode == "allow" and net.ports else
                                            (None if net.mode == "allow" else (443, 80)))
    for k, v in more.items():   # create's own options, given
        kw[k] = {**kw[k], **v} if k == "tags" else v
    return tuple(command) or file_command, kw


def _file_option(f):
    return click.option("--file", "-f", "sandbox_file", type=click.Path(dir_okay=False), metavar="FILE",
                        help="A sandbox file (TOML, docs/sandbox-file.md); the other options given add to or "
                             "replace its values.")(f)


def _stream(p) -> int:
    """Copy the command's output to ours as it arrives and our stdin to it; return the process once it ended."""
    def forward_stdin():
        try:
            while chunk := os.read(0, 65536):
                p.stdin.write(chunk)
        except OSError:
            pass   # no usable stdin (closed, or the command ended): end-of-file
        try:
            p.stdin.close()
        except Exception:
            pass   # the command ended first

    threading.Thread(target=forward_stdin, daemon=True).start()
    outs = {1: sys.stdout.buffer, 2: sys.stderr.buffer}
    for fd, data in p._chunks():
        outs[fd].write(data)
        outs[fd].flush()
    p.wait()
    return p


def _command_ended(p, sb) -> int:
    """One line on stderr saying why the command ended, unless it exited by itself; the CLI's exit code
    (README: its own code, 124 timeout, 137 out of memory, 128+N killed by signal N)."""
    from hutch.sandbox._api import command_end

    if p.reason == "sandbox_ended":
        sb.poll()   # the daemon's answer says why the sandbox ended
    why, code, _cls = command_end(p.reason, p.returncode, sb.info)
    if why:
        click.echo(f"hutch: the command {why}.", err=True)
    return code


def _sandbox_ended(sb) -> int:
    """The same for a sandbox that ended while this command held it."""
    from hutch.sandbox._api import sandbox_end

    sb.poll()
    why, code, _cls = sandbox_end(sb.info)
    if why:
        click.echo(f"hutch: {why}.", err=True)
    return code


def terminal_options(f):
    f = click.option("--tty", "-t", is_flag=True,
                     help="Run COMMAND on a terminal in the sandbox (a pty: colours, line editing, Ctrl-C, resize).")(f)
    return click.option("--interactive", "-i", is_flag=True,
                        help="With -t: type into it (this terminal in raw mode). Without -t stdin is forwarded anyway.")(f)


def _on_terminal(sb, command, interactive: bool, **kw) -> int:
    """COMMAND on a terminal in `sb`, joined to ours; the CLI's exit code."""
    from hutch.cli._terminal import attach, local_size, pty_env

    p = sb.exec(*command, pty=local_size(), env=pty_env(kw.pop("env", None) or {}), **kw)
    attach(p, interactive)
    return _command_ended(p, sb)


@click.command(context_settings={"ignore_unknown_options": False})
@sandbox_options
@_file_option
@terminal_options
@click.argument("command", nargs=-1)
def run(command, sandbox_file, interactive, tty, **opts):
    """Run COMMAND in a fresh sandbox, stream its output, and exit with its exit code.

    Standard input is forwarded. With -it, COMMAND runs on a terminal in the sandbox
    joined to this one (hutch run -it -- bash). The sandbox has no network unless --allow-domain
    or --allow-cidr is given, and nothing of it remains when the command ends.
    A command that did not end by itself gets one line on stderr saying why, and
    exit code 124 (timeout), 137 (out of memory) or 128+N (killed by signal N).

    \b
    Examples:
      hutch run -- python3 -c 'print(sum(range(10)))'
      hutch run --memory 1G -v ./data:/data -- ls -l /data
      echo hi | hutch run --image /srv/rootfs -- cat
      hutch run -f sandbox.toml -- python3 agent.py
      hutch run -it -- bash
    """
    import hutch

    if sandbox_file:   # the file's command runs as this one would, in a sandbox that waits for it
        command, kw = file_kwargs(sandbox_file, opts, command)
    else:
        kw = create_kwargs(**opts)
    if not command:
        raise click.UsageError("give the COMMAND to run (after --), or a sandbox file whose command = [...] it is.")
    with hutch.Sandbox.create(**kw) as sb:
        if tty:
            rc = _on_terminal(sb, command, interactive)
        else:
            rc = _command_ended(_stream(sb.exec(*command, stdin=True, text=False)), sb)
    sys.exit(rc)


@click.group()
def sandbox():
    """Create, inspect and end long-lived sandboxes.

    \b
    Examples:
      id=$(hutch sandbox create --detach --tag job=ci)
      hutch sandbox exec "$id" -- python3 -c 'print(1)'
      hutch sandbox ls --tag job=ci
      hutch sandbox kill "$id"
    """


@sandbox.command("create")
@sandbox_options
@click.option("--name", help="A unique name to find the sandbox by.")
@click.option("--tag", "-t", multiple=True, metavar="K=V", help="A tag (repeatable); `ls --tag` filters by them.")
@click.option("--idle-timeout", type=float, help="End the sandbox after this many seconds without activity.")
@click.option("--on-idle", type=click.Choice(["terminate", "pause"]), default="terminate", show_default=True,
              help="What --idle-timeout does: end the sandbox, or pause it (the next call resumes it).")
@click.option("--detach", "-d", is_flag=True, help="Print the id and exit; the sandbox lives until its timeout or kill.")
@_file_option
@click.argument("command", nargs=-1)
def create(command, name, tag, idle_timeout, on_idle, detach, sandbox_file, **opts):
    """Create a sandbox and print its id.

    With --detach it outlives this command (until its --timeout or `hutch sandbox kill`);
    without, this command holds it until you press Ctrl-C. An optional COMMAND becomes
    the sandbox's main process: the sandbox lives as long as it runs.

    \b
    Example:
      hutch sandbox create --detach --timeout 600 --tag owner=me
      hutch sandbox create -f sandbox.toml --detach
    """
    import hutch

    if sandbox_file:
        given = dict(name=name, tags=_pairs(tag, "--tag") or None, idle_timeout=idle_timeout, detach=detach or None,
                     on_idle=None if on_idle == "terminate" else on_idle)
        command, kw = file_kwargs(sandbox_file, opts, command, **{k: v for k, v in given.items() if v is not None})
        detach = kw["detach"]
    else:
        kw = dict(name=name, tags=_pairs(tag, "--tag"), idle_timeout=idle_timeout, on_idle=on_idle, detach=detach,
                  **create_kwargs(**opts))
    sb = hutch.Sandbox.create(*command, **kw)
    click.echo(sb.id)
    if detach:
        return
    try:
        sb.wait()
        rc = _sandbox_ended(sb)
    except KeyboardInterrupt:
        rc = 0
    finally:
        sb.terminate()
    sys.exit(rc)


@sandbox.command("exec")
@click.argument("sandbox_id")
@click.argument("command", nargs=-1, required=True)
@click.option("--env", "-e", multiple=True, metavar="K=V", help="An environment variable (repeatable).")
@click.option("--workdir", "-w", help="Working directory inside the sandbox.")
@click.option("--timeout", type=float, help="End the command (not the sandbox) after this many seconds.")
@click.option("--user", type=click.Choice(["root", "user"]), default="root", show_default=True,
              help="Run as the sandbox's root (no capabilities) or its unprivileged user (uid 1000).")
@terminal_options
def exec_(sandbox_id, command, env, workdir, timeout, user, interactive, tty):
    """Run COMMAND in the sandbox SANDBOX_ID (id or name), streaming its output and stdin.

    \b
    Examples:
      hutch sandbox exec my-box -- sh -c 'ls /home/user'
      hutch sandbox exec -it my-box -- python3
    """
    import hutch

    sb = hutch.Sandbox.from_id(sandbox_id)
    if tty:
        sys.exit(_on_terminal(sb, command, interactive, env=_pairs(env, "--env"), workdir=workdir, timeout=timeout,
                              user=user))
    p = sb.exec(*command, env=_pairs(env, "--env"), workdir=workdir, timeout=timeout, stdin=True, text=False,
                user=user)
    sys.exit(_command_ended(_stream(p), sb))


exec_.name = "exec"


@sandbox.command("ls")
@click.option("--tag", "-t", multiple=True, metavar="K=V", help="Only sandboxes with this tag (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's records as JSON.")
def ls(tag, as_json):
    """List the sandboxes on this host.

    \b
    Example:
      hutch sandbox ls --tag job=ci
    """
    import hutch

    sbs = hutch.Sandbox.list(tags=_pairs(tag, "--tag") or None)
    if as_json:
        click.echo(json.dumps([s.info for s in sbs], indent=1))
        return
    click.echo(f"{'ID':<24} {'NAME':<20} {'STATUS':<12} TAGS")
    for s in sbs:
        tags = ",".join(f"{k}={v}" for k, v in sorted(s.tags.items()))
        click.echo(f"{s.id:<24} {s.name or '-':<20} {s.status:<12} {tags}")


@sandbox.command("kill")
@click.argument("sandbox_ids", nargs=-1, required=True)
def kill(sandbox_ids):
    """End the given sandboxes (ids or names) now; returns when everything they had is gone.

    \b
    Example:
      hutch sandbox kill sb-1a2b3c my-box
    """
    import hutch

    for sid in sandbox_ids:
        hutch.Sandbox.from_id(sid).terminate()
        click.echo(sid)


@sandbox.command("pause")
@click.argument("sandbox_ids", nargs=-1, required=True)
def pause(sandbox_ids):
    """Stop every process of the given sandboxes where it is, memory kept (`resume`, or any exec, wakes them).

    \b
    Example:
      hutch sandbox pause my-box
    """
    import hutch

    for sid in sandbox_ids:
        hutch.Sandbox.from_id(sid).pause()
        click.echo(sid)


@sandbox.command("resume")
@click.argument("sandbox_ids", nargs=-1, required=True)
def resume(sandbox_ids):
    """Let paused sandboxes run again.

    \b
    Example:
      hutch sandbox resume my-box
    """
    import hutch

    for sid in sandbox_ids:
        hutch.Sandbox.from_id(sid).resume()
        click.echo(sid)


@sandbox.command("snapshot")
@click.argument("sandbox_id")
def snapshot(sandbox_id):
    """Take a memory snapshot (processes, memory, filesystem) of a gVisor sandbox; print its id. It runs on.

    \b
    Example:
      snap=$(hutch sandbox snapshot my-box) && hutch sandbox restore "$snap"
    """
    import hutch

    click.echo(hutch.Sandbox.from_id(sandbox_id).snapshot_memory().id)


@sandbox.command("restore")
@click.argument("snapshot_id")
@click.option("--tag", "-t", multiple=True, metavar="K=V", help="A tag of the new sandbox (repeatable).")
def restore(snapshot_id, tag):
    """Start a new (detached) sandbox from a memory snapshot, carrying on where its sandbox was; print its id.

    \b
    Example:
      hutch sandbox restore 3f9c0d...
    """
    import hutch

    click.echo(hutch.Sandbox.restore(snapshot_id, detach=True, tags=_pairs(tag, "--tag")).id)


@sandbox.command("fork")
@click.argument("sandbox_id")
@click.option("-n", "count", type=int, default=1, show_default=True, help="How many copies.")
def fork(sandbox_id, count):
    """Make N running (detached) copies of a gVisor sandbox, each with its own filesystem and identity; print
    their ids, one a line.

    \b
    Example:
      hutch sandbox fork my-box -n 4
    """
    import hutch

    for kid in hutch.Sandbox.from_id(sandbox_id).fork(count, detach=True):
        click.echo(kid.id)


@sandbox.command("netlog")
@click.argument("sandbox_id")
@click.option("--json", "as_json", is_flag=True, help="Print the whole log (decisions and counters) as JSON.")
def netlog(sandbox_id, as_json):
    """Show the egress gateway's decisions for a sandbox, oldest first, then what it did not keep.

    Refusals are counted by reason and by name/address even when a flood kept them out of the
    list; the summary under the list says how many decisions of each kind were dropped.

    \b
    Example:
      hutch sandbox netlog sb-1a2b3c
    """
    import hutch

    log = hutch.Sandbox.from_id(sandbox_id).network_log()
    if as_json:
        click.echo(json.dumps({"decisions": list(log.decisions), "seen": log.seen, "dropped": log.dropped,
                               "refusals_by_reason": list(log.refusals_by_reason),
                               "refusals_by_target": list(log.refusals_by_target), "limits": log.limits}, indent=1))
        return
    click.echo(f"{'TIME':<12} {'VERDICT':<7} {'PROTO':<6} {'NAME':<32} {'ADDRESS':<16} {'PORT':<5} REASON")
    for d in log:
        click.echo(f"{_clock(d['time']):<12} {d['verdict']:<7} {d['protocol']:<6} {(d['name'] or '-'):<32} "
                   f"{(d['address'] or '-'):<16} {str(d['port'] or '-'):<5} {d['reason']}")
    dropped = {k: n for k, n in log.dropped.items() if n}
    if dropped:
        click.echo("\nnot listed above (over the log's rate limit or pushed out by newer ones): "
                   + ", ".join(f"{n} {k}" for k, n in dropped.items()))
    if any(log.dropped.values()) and log.refusals_by_target:
        click.echo("\nrefused, by name or address (every refusal counted; most often first):")
        for r in sorted(log.refusals_by_target, key=lambda r: (r["target"] is None, -r["count"])):
            click.echo(f"  {r['count']:>7}x {r['protocol'] or '*':<6} {(r['target'] or '(all other targets)'):<40} "
                       f"{_clock(r['first'])} .. {_clock(r['last'])}  {r['last_reason']}")
        click.echo("refused, by reason:")
        for r in log.refusals_by_reason:
            click.echo(f"  {r['count']:>7}x {r['protocol'] or '*':<6} {r['reason'] or '(all other reasons)'}  "
                       f"{_clock(r['first'])} .. {_clock(r['last'])}")
    held = {k: n for k, n in log.limits.items() if n and k != "dns_queries"}
    if held:
        click.echo("\nheld back by the per-sandbox limits: " + ", ".join(f"{k}={n}" for k, n in held.items()))


def _clock(t: float) -> str:
    import time

    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


def _refuse_token_on_argv(ctx, param, value):
    if value is not None:
        raise click.UsageError("--token would put the token in /proc/<pid>/cmdline, where every user can read it: "
                               "write it to a file only root can read and pass --token-file PATH (or set HUTCH_TOKEN).")


@click.command()
@click.option("--listen", metavar="HOST:PORT", help="Also serve remote clients over TCP with TLS (needs a token).")
@click.option("--token-file", type=click.Path(dir_okay=False), metavar="PATH",
              help="File holding the bearer token TCP clients must send (mode 0600; else env HUTCH_TOKEN).")
@click.option("--token", hidden=True, expose_value=False, callback=_refuse_token_on_argv,
              help="Refused: use --token-file.")
@click.option("--group", metavar="NAME", help="Let members of this group use the Unix socket too (default: root only).")
@click.option("--tls-cert", type=click.Path(dir_okay=False), metavar="PEM",
              help="Certificate of the TCP listener (default: one made on first start under the state dir).")
@click.option("--tls-key", type=click.Path(dir_okay=False), metavar="PEM", help="Key of --tls-cert (mode 0600).")
@click.option("--socket", "socket_path", type=click.Path(), help="Unix socket path (default: HUTCH_SOCKET or /run/hutch/hutch.sock).")
@click.option("--header-timeout", type=float, metavar="S", help="Seconds a request head may take (default 10).")
@click.option("--idle-timeout", type=float, metavar="S", help="Seconds an idle connection is kept (default 60).")
@click.option("--max-tcp", type=int, metavar="N", help="TCP connections at once (default 1024).")
@click.option("--max-tcp-per-peer", type=int, metavar="N",
              help="Unauthenticated TCP connections from one address (default 16).")
@click.option("--tenants", "tenants_file", type=click.Path(dir_okay=False), metavar="FILE",
              help="Serve tenants (`hutch tenant add`): each token sees only its own sandboxes, within its quotas.")
@click.option("--audit-log", type=click.Path(dir_okay=False), metavar="PATH",
              help="Write a JSON line per call that changes something (root's, 0600, rotated).")
@click.option("--audit-max-bytes", type=int, default=16 << 20, show_default=True, metavar="N",
              help="Rotate the audit log at this size.")
@click.option("--audit-keep", type=int, default=5, show_default=True, metavar="N",
              help="Rotated audit logs kept (PATH.1 newest).")
@click.option("--id-prefix", metavar="KEY", default="",
              help="Start every sandbox id with KEY and a dash (a fleet node's key: docs/fleet.md).")
@click.option("--max-sandboxes", type=click.IntRange(min=0), default=0, metavar="N",
              help="Sandboxes this daemon runs at once at most (creates, restores and forks beyond it get a 429 "
                   "QuotaExceededError, quota host_sandboxes: retry later or elsewhere); 0: no cap.")
def serve(listen, token_file, group, tls_cert, tls_key, socket_path, header_timeout, idle_timeout, max_tcp,
          max_tcp_per_peer, tenants_file, audit_log, audit_max_bytes, audit_keep, id_prefix, max_sandboxes):
    """Run the host daemon that owns this host's sandboxes (SDK and CLI start it when none runs).

    The Unix socket serves root, and the members of --group if given. With --listen,
    TCP clients speak TLS and send the token; the daemon prints its certificate's
    fingerprint for them to pin (HUTCH_FINGERPRINT), as `hutch tls-fingerprint` does.

    \b
    Examples:
      hutch serve --group hutch
      openssl rand -hex 32 > /etc/hutch/token && chmod 600 /etc/hutch/token
      hutch serve --listen 0.0.0.0:7450 --token-file /etc/hutch/token
      hutch serve --listen 0.0.0.0:7450 --tenants /etc/hutch/tenants.json --audit-log /var/log/hutch/audit.jsonl
    """
    from hutch.sandbox._host.daemon import ListenLimits
    from hutch.sandbox._host.daemon import serve as serve_daemon

    if listen and not token_file and not settings.TOKEN.is_set() and not tenants_file:
        raise click.UsageError("--listen needs a token: --token-file PATH (or HUTCH_TOKEN); remote clients must "
                               "authenticate.")
    given = {k: v for k, v in dict(header_timeout=header_timeout, idle_timeout=idle_timeout, max_tcp=max_tcp,
                                   max_tcp_per_peer=max_tcp_per_peer).items() if v is not None}
    serve_daemon(socket_path=socket_path, listen=listen, token_file=token_file, group=group, tls_cert=tls_cert,
                 tls_key=tls_key, limits=ListenLimits(**given), tenants=tenants_file, audit_log=audit_log,
                 audit_max_bytes=audit_max_bytes, audit_keep=audit_keep, id_prefix=id_prefix,
                 max_sandboxes=max_sandboxes)


@click.command("tls-fingerprint")
@click.option("--tls-cert", type=click.Path(dir_okay=False), metavar="PEM",
              help="A certificate given to `hutch serve --tls-cert` (default: the one the daemon made).")
def tls_fingerprint(tls_cert):
    """Print the SHA-256 fingerprint of the daemon's TLS certificate, for clients' HUTCH_FINGERPRINT.

    Without --tls-cert it is the certificate `hutch serve --listen` made under the state
    directory (made now, as root, if there is none yet).

    \b
    Example:
      export HUTCH_FINGERPRINT=$(ssh host hutch tls-fingerprint)
    """
    from hutch.sandbox._host.daemon.tls import fingerprint, made_certificate

    click.echo(fingerprint(tls_cert or made_certificate()))


@click.command()
@click.argument("path", type=click.Path(dir_okay=False), required=False)
@click.option("--schema", "print_schema", is_flag=True, help="Print the sandbox file's JSON Schema instead.")
def validate(path, print_schema):
    """Check the sandbox file PATH without creating anything; errors name its line and key, and the fix.

    Exit code 0 if it is valid (and a one-line summary), 1 if not. Host paths
    are checked as a create would (a bind's source must exist).

    \b
    Examples:
      hutch validate sandbox.toml
      hutch validate --schema > sandbox-file.schema.json
    """
    import hutch

    if print_schema:
        click.echo(json.dumps(hutch.SandboxFile.schema(), indent=2))
        return
    if not path:
        raise click.UsageError("give the PATH of a sandbox file, or --schema.")
    f = hutch.SandboxFile.load(path)
    s = f.spec
    net = s.network.mode + (f" ({', '.join(s.network.domains + s.network.cidrs)})" if s.network.mode == "allow" else "")
    click.echo(f"{path}: valid: image {f.image.ref}{f' + {len(f.image.steps)} steps' if f.image.steps else ''}, "
               f"{len(s.mounts) + len(f.provided)} mounts, network {net}, memory {s.limits.memory} bytes, "
               f"cpu {s.limits.cpu}, timeout {s.timeout if s.timeout is not None else 'never'}")
    if f.environment:   # what a create would read from this environment: a file is as trusted as what it reads
        click.echo(f"{path}: reads from the environment at create: {', '.join(f.environment)}")
