"""The OpenAPI 3 document of the daemon's HTTP API (served at GET /v1/openapi.json; prose in docs/api.md)."""

from __future__ import annotations

from hutch._version import VERSION
from hutch.sandbox._spec import BUILD_CAPABILITIES, EXEC_USERS, NAME_PATTERN, ON_IDLE, RUNTIMES

_ERR = {"description": "a hutch error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_INFO = {"description": "sandbox info", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Sandbox"}}}}
_NO_CONTENT = {"description": "done"}


def _q(name: str, desc: str, required: bool = False, schema: dict | None = None) -> dict:
    return {"name": name, "in": "query", "required": required, "description": desc, "schema": schema or {"type": "string"}}


def _json_body(schema: dict, required: bool = True) -> dict:
    return {"required": required, "content": {"application/json": {"schema": schema}}}


def _raw_body() -> dict:
    return {"required": False, "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}


def _json_ok(schema: dict, desc: str = "ok", code: str = "200") -> dict:
    return {code: {"description": desc, "content": {"application/json": {"schema": schema}}}}


_PATH_Q = _q("path", "a path inside the sandbox (relative: from its workdir)", True, {"type": "string", "minLength": 1})
_FLAG = {"type": "string", "enum": ["0", "1", "true", "false", "yes", "no"]}
_MODE = {"type": "string", "pattern": "^[0-7]{1,4}$"}
_TIMEOUT_Q = _q("timeout", "seconds to wait at most", schema={"type": "number", "minimum": 0})

# (method, path) -> operation
OPERATIONS: dict[tuple[str, str], dict] = {
    ("get", "/v1/health"): {"summary": "Daemon version, pid and live sandboxes; 503 with the reason while it cannot "
                                       "start sandboxes",
                            "responses": {**_json_ok({"type": "object", "properties": {
                                "version": {"type": "string"}, "pid": {"type": "integer"},
                                "sandboxes": {"type": "integer"}, "max_sandboxes": {"type": "integer"}}}),
                                          "503": _ERR}},
    ("get", "/v1/openapi.json"): {"summary": "This document", "responses": _json_ok({"type": "object"})},
    ("get", "/v1/doctor"): {"summary": "How this daemon runs sandboxes: isolation mode and why, cgroups, idmap, "
                                       "egress, warm pool, image cache",
                            "responses": _json_ok({"type": "object", "properties": {
                                "mode": {"type": "string"}, "userns": {"type": "boolean"},
                                "userns_why_not": {"type": "string", "nullable": True},
                                "idmap": {"type": "boolean", "nullable": True}, "cgroup": {"type": "object"},
                                "egress": {"type": "boolean"}, "warm_pool": {"type": "object"},
                                "gvisor": {"type": "object"}, "freezer": {"type": "boolean"},
                                "images": {"type": "object"}}})},
    ("get", "/v1/tenant"): {"summary": "Who the caller is: the operator, or a tenant with its quotas and their use "
                                       "(docs/tenants.md)",
                            "responses": _json_ok({"type": "object", "required": ["name", "operator"], "properties": {
                                "name": {"type": "string", "nullable": True}, "operator": {"type": "boolean"},
                                "tenants": {"type": "boolean"}, "quotas": {"$ref": "#/components/schemas/Quotas"},
                                "use": {"$ref": "#/components/schemas/Quotas"},
                                "images": {"type": "array", "items": {"type": "string"}}}})},
    ("post", "/v1/sandboxes"): {"summary": "Create a sandbox (a tenant over a quota: 429 QuotaError)",
                                "requestBody": _json_body({"type": "object", "required": ["spec"],
                                                           "properties": {"spec": {"$ref": "#/components/schemas/SandboxSpec"}}}),
                                "responses": {"201": _INFO}},
    ("get", "/v1/sandboxes"): {"summary": "List running sandboxes",
                               "parameters": [_q("tag", "key:value; repeatable, all must match")],
                               "responses": _json_ok({"type": "object", "properties": {"sandboxes": {
                                   "type": "array", "items": {"$ref": "#/components/schemas/Sandbox"}}}})},
    ("get", "/v1/sandboxes/{id}"): {"summary": "A sandbox by id or name", "responses": {"200": _INFO}},
    ("post", "/v1/sandboxes/{id}/terminate"): {"summary": "End a sandbox; answers once every resource is gone",
                                               "responses": {"200": _INFO}},
    ("post", "/v1/sandboxes/{id}/pause"): {"summary": "Stop every process of a sandbox, memory kept (cgroup freezer); "
                                                      "exec and file calls resume it", "responses": {"200": _INFO}},
    ("post", "/v1/sandboxes/{id}/resume"): {"summary": "Let a paused sandbox run again", "responses": {"200": _INFO}},
    ("post", "/v1/sandboxes/{id}/snapshot-memory"): {"summary": "Memory snapshot of a gVisor sandbox (it runs on)",
                                                     "responses": {"201": {"description": "the snapshot"}}},
    ("post", "/v1/sandboxes/{id}/fork"): {"summary": "n running copies of a gVisor sandbox",
                                          "requestBody": _json_body({"type": "object", "properties": {
                                              "n": {"type": "integer", "minimum": 1, "maximum": 16},
                                              "detach": {"type": "boolean"}}}, required=False),
                                          "responses": {"201": {"description": "{sandboxes: [info, ...]}"}}},
    ("get", "/v1/memory-snapshots"): {"summary": "The memory snapshots of this host",
                                      "responses": {"200": {"description": "{snapshots: [...]}"}}},
    ("get", "/v1/memory-snapshots/{sid}"): {"summary": "One memory snapshot", "responses": {"200": {"description": "it"}}},
    ("delete", "/v1/memory-snapshots/{sid}"): {"summary": "Delete a memory snapshot", "responses": {"204": {"description": "gone"}}},
    ("get", "/v1/memory-snapshots/{sid}/export"): {"summary": "A memory snapshot as a tar archive (to import on "
                                                             "another host)",
                                                  "responses": {"200": {"description": "application/x-tar"}}},
    ("get", "/v1/memory-snapshots/{sid}/digest"): {"summary": "A memory snapshot's digest (its metadata, memory "
                                                             "files and image; what an import's digest= expects)",
                                                  "responses": {"200": {"description": "{id, digest, owner, owner_image}"}}},
    ("post", "/v1/memory-snapshots/import"): {"summary": "Import a memory snapshot archive (checked as hostile input); "
                                                         "with digest, only the snapshot of that digest, under its "
                                                         "own id",
                                             "parameters": [_q("digest", "the 64-hex-digit digest the source's "
                                                               "GET /v1/memory-snapshots/{sid}/digest answered",
                                                               schema={"type": "string", "pattern": "^[0-9a-f]{64}$"}),
                                                            _q("base", "the base its filesystem sits on (a dir: base "
                                                               "is taken only if named here, or with digest)",
                                                               schema={"type": "string", "minLength": 1,
                                                                       "maxLength": 4096}),
                                                            _q("owner", "with digest: the tenant to keep it as (the "
                                                               "owner the source's digest answer names)"),
                                                            _q("owner_image", "with owner: the image its source showed "
                                                               "that tenant (the digest answer's owner_image)")],
                                             "requestBody": {"required": True, "content": {"application/x-tar": {
                                                 "schema": {"type": "string", "format": "binary"}}}},
                                             "responses": {"201": {"description": "the new snapshot"}}},
    ("post", "/v1/memory-snapshots/{sid}/restore"): {"summary": "A new sandbox from a memory snapshot",
                                                     "requestBody": _json_body({"type": "object", "properties": {
                                                         "detach": {"type": "boolean"},
                                                         "tags": {"type": "object",
                                                                  "additionalProperties": {"type": "string"}}}},
                                                         required=False),
                                                     "responses": {"201": _INFO}},
    ("post", "/v1/sandboxes/{id}/wait"): {"summary": "Long poll until the sandbox ends or the timeout passes",
                                          "parameters": [_TIMEOUT_Q],
                                          "responses": {"200": _INFO}},
    ("get", "/v1/sandboxes/{id}/lease"): {"summary": "Held open by the creator; closing it ends a non-detached sandbox",
                                          "responses": {"200": {"description": "a response that stays open"}}},
    ("post", "/v1/sandboxes/{id}/exec"): {
        "summary": "Run a command; the body streams its output frames",
        "requestBody": _json_body({"type": "object", "required": ["argv"], "properties": {
            "argv": {"type": "array", "items": {"type": "string"}, "minItems": 1},
            "env": {"type": "object", "additionalProperties": {"type": "string"}},
            "workdir": {"type": "string", "nullable": True, "pattern": "^/"},
            "timeout": {"type": "number", "nullable": True, "exclusiveMinimum": True, "minimum": 0},
            "stdin": {"type": "boolean"},
            "user": {"type": "string", "enum": list(EXEC_USERS),
                     "description": "user: the sandbox's unprivileged user, uid/gid 1000 (default root)"},
            "stdout": {"type": "boolean", "description": "false: the command's stdout is /dev/null (default true)"},
            "stderr": {"type": "boolean", "description": "false: the command's stderr is /dev/null (default true)"},
            "pty": {"type": "object", "nullable": True,
                    "description": "refused here (400): a terminal is GET /v1/sandboxes/{id}/exec/pty"},
            "max_output": {"type": "integer", "nullable": True, "minimum": 0,
                           "description": "bytes of each stream sent; the rest is drained, dropped and counted "
                                          "in the exit frame (stdout_dropped, stderr_dropped)"}}}),
        "responses": {"200": {"description": "frames: 1 byte kind (1 stdout, 2 stderr, 3 exit), 4 bytes length, payload",
                              "headers": {"X-Hutch-Exec-Id": {"schema": {"type": "string"}}},
                              "content": {"application/x-hutch-frames": {"schema": {"type": "string", "format": "binary"}}}}}},
    ("get", "/v1/sandboxes/{id}/exec/pty"): {
        "summary": "Run a command on a terminal made in the sandbox: a WebSocket (docs/api.md, Terminals)",
        "description": "First message (text): the exec body with pty {rows, cols}. Then binary messages are the "
                       "terminal's bytes both ways; text: {\"resize\": [rows, cols]} or {\"signal\": N} from the "
                       "client, {\"eid\"}, {\"exit\": {returncode, reason}} or {\"error\", \"message\"} from "
                       "the daemon. Closing it hangs up: the command's session is killed.",
        "responses": {"101": {"description": "switching to the WebSocket protocol"}}},
    ("post", "/v1/sandboxes/{id}/exec/{eid}/stdin"): {"summary": "Write to a command's stdin",
                                                      "parameters": [_q("eof", "1 closes stdin after the bytes", schema=_FLAG)],
                                                      "requestBody": _raw_body(), "responses": {"204": _NO_CONTENT}},
    ("post", "/v1/sandboxes/{id}/exec/{eid}/wait"): {
        "summary": "Long poll until the command ends or the timeout passes (its output stays on its stream)",
        "parameters": [_TIMEOUT_Q],
        "responses": _json_ok({"type": "object", "properties": {
            "returncode": {"type": "integer", "nullable": True, "description": "null while it runs"},
            "reason": {"type": "string", "nullable": True}}})},
    ("post", "/v1/sandboxes/{id}/exec/{eid}/kill"): {"summary": "Signal a command's process group",
                                                     "requestBody": _json_body({"type": "object", "properties": {
                                                         "signal": {"type": "integer", "minimum": 1, "maximum": 64}}}, required=False),
                                                     "responses": {"204": _NO_CONTENT}},
    ("get", "/v1/sandboxes/{id}/files/read"): {"summary": "Read a file", "parameters": [_PATH_Q],
                                               "responses": {"200": {"description": "its bytes", "content": {
                                                   "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}},
    ("put", "/v1/sandboxes/{id}/files/write"): {"summary": "Write a file atomically (parents are created)",
                                                "parameters": [_PATH_Q, _q("mode", "octal permission bits, default 0644", schema=_MODE)],
                                                "requestBody": _raw_body(), "responses": {"204": _NO_CONTENT}},
    ("get", "/v1/sandboxes/{id}/files/list"): {"summary": "List a directory", "parameters": [_PATH_Q],
                                               "responses": _json_ok({"type": "object", "properties": {"entries": {
                                                   "type": "array", "items": {"$ref": "#/components/schemas/Entry"}}}})},
    ("get", "/v1/sandboxes/{id}/files/stat"): {"summary": "Describe a path (symlinks are not followed)",
                                               "parameters": [_PATH_Q],
                                               "responses": _json_ok({"$ref": "#/components/schemas/Entry"})},
    ("post", "/v1/sandboxes/{id}/files/remove"): {"summary": "Remove a file or directory",
                                                  "parameters": [_PATH_Q, _q("recursive", "1: a directory and everything in it", schema=_FLAG)],
                                                  "responses": {"204": _NO_CONTENT}},
    ("post", "/v1/sandboxes/{id}/files/mkdir"): {"summary": "Make a directory",
                                                 "parameters": [_PATH_Q, _q("parents", "1: make missing parents too", schema=_FLAG)],
                                                 "responses": {"204": _NO_CONTENT}},
    ("post", "/v1/images/ensure"): {"summary": "Build an image if it is missing; streams NDJSON progress",
                                    "requestBody": _json_body({"type": "object", "required": ["ref"], "properties": {"ref": {"type": "string"}}}),
                                    "responses": {"200": {"description": "progress events, then {done} or {error}",
                                                          "content": {"application/x-ndjson": {"schema": {"type": "string"}}}}}},
    ("get", "/v1/images"): {"summary": "Cached images",
                            "responses": _json_ok({"type": "object", "properties": {"images": {"type": "array", "items": {"type": "object"}}}})},
    ("put", "/v1/sandboxes/{id}/network"): {"summary": "Replace a running sandbox's egress policy",
                                            "requestBody": _json_body({"type": "object", "required": ["network"], "properties": {
                                                "network": {"$ref": "#/components/schemas/Network"}}}),
                                            "responses": {"204": _NO_CONTENT}},
    ("get", "/v1/sandboxes/{id}/network/log"): {"summary": "The egress gateway's decisions kept, and counts of all of them",
                                                "responses": _json_ok({"type": "object", "properties": {
                                                    "decisions": {"type": "array", "items": {"type": "object"}},
                                                    "seen": {"type": "object"}, "dropped": {"type": "object"},
                                                    "refusals_by_reason": {"type": "array", "items": {"type": "object"}},
                                                    "refusals_by_target": {"type": "array", "items": {"type": "object"}},
                                                    "limits": {"type": "object"}}})},
}

_SCHEMAS = {
    "Error": {"type": "object", "required": ["error", "message"], "properties": {
        "error": {"type": "string", "description": "name of the hutch.Error subclass"},
        "message": {"type": "string", "description": "a sentence naming the fix"}}},
    "QuotaError": {"type": "object", "required": ["error", "message", "quota", "limit", "used"],
                   "description": "429: a tenant's quota would be exceeded (error QuotaExceededError); nothing was made",
                   "properties": {
        "error": {"type": "string", "enum": ["QuotaExceededError"]}, "message": {"type": "string"},
        "quota": {"type": "string", "enum": ["sandboxes", "cpu", "memory", "disk", "creates_per_second",
                                             "egress_bytes_per_day"]},
        "limit": {"type": "number"}, "used": {"type": "number"}}},
    "Quotas": {"type": "object", "description": "a tenant's quotas (absent: unlimited), or their use", "properties": {
        "sandboxes": {"type": "integer"}, "cpu": {"type": "number"}, "memory": {"type": "integer"},
        "disk": {"type": "integer"}, "creates_per_second": {"type": "number"},
        "egress_bytes_per_day": {"type": "integer"}}},
    "Sandbox": {"type": "object", "properties": {
        "id": {"type": "string"}, "name": {"type": "string", "nullable": True}, "tags": {"type": "object"},
        "status": {"type": "string", "enum": ["starting", "running", "paused", "exited", "terminated", "timeout",
                                              "idle_timeout", "oom", "failed"]},
        "returncode": {"type": "integer", "nullable": True}, "created_at": {"type": "number"},
        "ended_at": {"type": "number", "nullable": True}, "detach": {"type": "boolean"},
        "spec": {"$ref": "#/components/schemas/SandboxSpec"},
        "cgroups": {"type": "array", "items": {"type": "string"},
                    "description": "the sandbox's cgroup directories on the daemon's host while it runs: a host "
                                   "process that works for it (a memory view) joins them"}}},
    "SandboxSpec": {"type": "object", "description": "hutch.sandbox._spec.SandboxSpec.to_dict(); every field optional",
                    "properties": {
        "command": {"type": "array", "items": {"type": "string"}, "description": "argv of its main command"},
        "image": {"type": "string", "minLength": 1,
                  "description": "debian-slim, dir:<absolute root>, image:<64 hex>, or a built image's name"},
        "mounts": {"type": "array", "items": {"$ref": "#/components/schemas/Mount"}},
        "network": {"$ref": "#/components/schemas/Network"},
        "limits": {"$ref": "#/components/schemas/Limits"},
        "timeout": {"type": "number", "nullable": True, "exclusiveMinimum": True, "minimum": 0},
        "idle_timeout": {"type": "number", "nullable": True, "exclusiveMinimum": True, "minimum": 0},
        "workdir": {"type": "string", "pattern": "^/"},
        "env": {"$ref": "#/components/schemas/Pairs"}, "tags": {"$ref": "#/components/schemas/Pairs"},
        "name": {"type": "string", "nullable": True, "pattern": NAME_PATTERN},
        "detach": {"type": "boolean", "description": "false: ended when its creator's lease closes"},
        "capabilities": {"type": "array", "items": {"type": "string", "enum": list(BUILD_CAPABILITIES)}},
        "runtime": {"type": "string", "enum": list(RUNTIMES), "description": "native (default) or gvisor (runsc)"},
        "on_idle": {"type": "string", "enum": list(ON_IDLE), "description": "what idle_timeout does"}}},
    "Pairs": {"type": "array", "description": "[name, value] pairs",
              "items": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 2}},
    "Mount": {"type": "object", "required": ["kind", "target"], "properties": {
        "kind": {"type": "string", "enum": ["bind", "tmpfs", "volume"]},
        "target": {"type": "string", "pattern": "^/", "description": "absolute, without '..'"},
        "source": {"type": "string", "nullable": True, "description": "bind: a host path; volume: its name"},
        "readonly": {"type": "boolean"},
        "size": {"oneOf": [{"type": "integer", "minimum": 1}, {"type": "string"}], "nullable": True,
                 "description": "tmpfs only: bytes or a size like '64M'"},
        "owner": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 2, "maxItems": 2,
                  "nullable": True, "description": "bind only: host (uid, gid) that is root inside the bind"}}},
    "Network": {"type": "object", "properties": {
        "mode": {"type": "string", "enum": ["none", "allow", "open"]},
        "domains": {"type": "array", "items": {"type": "string"}},
        "cidrs": {"type": "array", "items": {"type": "string"}},
        "ports": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 65535}},
        "credentials": {"type": "object", "description": "allowed host -> Secret.to_dict(reveal=True): the gateway "
                                                         "adds it to the sandbox's HTTPS requests to that host",
                        "additionalProperties": {"$ref": "#/components/schemas/Secret"}},
        "requests_per_minute": {"type": "integer", "minimum": 1, "nullable": True,
                                "description": "budget of each domain or cidr entry (open: of all), a sliding minute"},
        "bytes_per_minute": {"type": "integer", "minimum": 1, "nullable": True,
                             "description": "bytes both ways, per entry like requests_per_minute"}}},
    "Secret": {"type": "object", "properties": {
        "env": {"type": "string", "nullable": True}, "header": {"type": "string"}, "format": {"type": "string"},
        "requests_per_minute": {"type": "integer", "minimum": 1, "nullable": True},
        "bytes_per_minute": {"type": "integer", "minimum": 1, "nullable": True},
        "value": {"type": "string", "nullable": True, "description": "the secret; never in an answer"}}},
    "Limits": {"type": "object", "properties": {
        "memory": {"oneOf": [{"type": "integer", "minimum": 1}, {"type": "string"}], "description": "bytes or '512M'"},
        "cpu": {"type": "number", "minimum": 0.01, "maximum": 1024},
        "pids": {"type": "integer", "minimum": 1, "maximum": 1 << 22},
        "disk": {"oneOf": [{"type": "integer", "minimum": 1}, {"type": "string"}], "description": "bytes or '1G'"}}},
    "Entry": {"type": "object", "properties": {
        "name": {"type": "string"}, "path": {"type": "string"},
        "type": {"type": "string", "enum": ["file", "dir", "symlink", "other"]},
        "size": {"type": "integer"}, "mode": {"type": "integer"}, "mtime": {"type": "number"}}},
}


from hutch.sandbox._host.daemon.store_routes import OPERATIONS as _STORE_OPERATIONS  # noqa: E402 - snapshots, images, volumes

OPERATIONS.update(_STORE_OPERATIONS)

_QUOTA_ERR = {"description": "a tenant's quota would be exceeded",
              "content": {"application/json": {"schema": {"$ref": "#/components/schemas/QuotaError"}}}}
#: The routes that charge a tenant's quotas (docs/tenants.md).
_QUOTA_ROUTES = {("post", "/v1/sandboxes"), ("post", "/v1/sandboxes/{id}/fork"),
                 ("post", "/v1/memory-snapshots/{sid}/restore"), ("post", "/v1/sandboxes/{id}/snapshot"),
                 ("put", "/v1/volumes/{name}/files/write")}


def openapi_document(app=None) -> dict:
    """The OpenAPI 3.0 document for every route above."""
    paths: dict[str, dict] = {}
    for (method, path), op in OPERATIONS.items():
        op = {**op, "operationId": f"{method}_{path.strip('/').replace('/', '_').replace('{', '').replace('}', '').replace('.', '_')}"}
        params = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                  for n in ("id", "eid", "key", "name", "sid") if "{" + n + "}" in path]
        if params:
            op["parameters"] = params + op.get("parameters", [])
        # every error is a 4xx with an Error body; a 5xx is a daemon bug, except 503 while it cannot serve
        op = {**op, "responses": {**op.get("responses", {}), "4XX": _ERR}}
        if (method, path) in _QUOTA_ROUTES:
            op["responses"]["429"] = _QUOTA_ERR
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.0.3",
        "info": {"title": "hutch daemon", "version": VERSION,
                 "description": "Sandboxes on this host. Errors: non-2xx with {error, message}. See docs/api.md."},
        "paths": paths,
        "components": {"schemas": _SCHEMAS,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "required on TCP, not on the Unix socket; "
                                                                     "a tenant's token on either (docs/tenants.md)"}}},
    }
