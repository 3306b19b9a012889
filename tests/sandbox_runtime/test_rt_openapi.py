"""The OpenAPI document and the code cannot drift: every route is described and every description is a
route, each handler reads exactly the query parameters and body fields its operation lists, and the
spec's schemas have the fields of the frozen value objects they describe. No daemon needed."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from hutch.sandbox._host.daemon.manager import Manager
from hutch.sandbox._host.daemon.openapi import openapi_document
from hutch.sandbox._host.daemon.server import make_app
from hutch.sandbox._spec import Limits, Mount, Network, SandboxSpec

DOC = openapi_document()
_APP = make_app(Manager.__new__(Manager))
ROUTES = {(r.method.lower(), r.resource.canonical): r.handler for r in _APP.router.routes() if r.method != "HEAD"}

# how a handler reads its query: the helpers of daemon/http.py, or request.query itself
_QUERY_READS = [(re.compile(r'query_(?:flag)\(request, "(\w+)"\)'), None), (re.compile(r"query_path\(request"), "path"),
                (re.compile(r"query_mode\(request\)"), "mode"), (re.compile(r"query_seconds\(request\)"), "timeout"),
                (re.compile(r'request\.query\.get(?:all)?\("(\w+)"'), None)]


def _query_read(handler) -> set[str]:
    src = inspect.getsource(handler)
    names = set()
    for rx, fixed in _QUERY_READS:
        for m in rx.finditer(src):
            names.add(fixed or m.group(1))
    return names


def _op(method, path) -> dict:
    return DOC["paths"][path][method]


def test_every_route_is_described_and_every_description_is_a_route():
    described = {(m, p) for p, ops in DOC["paths"].items() for m in ops}
    assert set(ROUTES) == described, f"undescribed: {set(ROUTES) - described}; no such route: {described - set(ROUTES)}"


@pytest.mark.parametrize("route", sorted(ROUTES), ids=lambda r: f"{r[0].upper()} {r[1]}")
def test_each_operation_lists_the_query_parameters_its_handler_reads(route):
    method, path = route
    listed = {p["name"] for p in _op(method, path).get("parameters", []) if p["in"] == "query"}
    assert _query_read(ROUTES[route]) == listed, f"{method.upper()} {path}"
    in_path = {p["name"] for p in _op(method, path).get("parameters", []) if p["in"] == "path"}
    assert in_path == set(re.findall(r"{(\w+)}", path))


@pytest.mark.parametrize("route", sorted(ROUTES), ids=lambda r: f"{r[0].upper()} {r[1]}")
def test_each_json_body_lists_the_fields_its_handler_reads(route):
    method, path = route
    src = inspect.getsource(ROUTES[route])
    read = set(re.findall(r'body\.get\("(\w+)"', src)) | set(re.findall(r'_(?:str_or_none|env)\(body(?:, "(\w+)")?', src))
    read = {r or "env" for r in read}
    reads_json = "json_body(request" in src
    body = _op(method, path).get("requestBody", {}).get("content", {})
    assert reads_json == ("application/json" in body), f"{method.upper()} {path}: JSON body read vs described"
    if reads_json:
        props = set(body["application/json"]["schema"].get("properties", {}))
        assert read == props, f"{method.upper()} {path}: read {sorted(read)}, described {sorted(props)}"


def test_the_spec_schemas_have_the_value_objects_fields():
    schemas = DOC["components"]["schemas"]
    for cls in (SandboxSpec, Mount, Network, Limits):
        fields = {f.name for f in dataclasses.fields(cls)}
        assert set(schemas[cls.__name__]["properties"]) == fields, cls.__name__


def test_the_document_is_valid_openapi():
    schemathesis = pytest.importorskip("schemathesis")
    schema = schemathesis.openapi.from_dict(DOC)
    assert len(list(schema.get_all_operations())) == len(ROUTES)
    assert all(op.ok() is not None for op in schema.get_all_operations())   # every operation loads
