"""hutch.Sandbox and hutch.AsyncSandbox (and their process, stream and files objects) offer the same surface."""

import inspect

import pytest

import hutch
from hutch.sandbox import _files, _process

PAIRS = [
    (hutch.Sandbox, hutch.AsyncSandbox),
    (_process.Process, _process.AsyncProcess),
    (_process.StreamReader, _process.AsyncStreamReader),
    (_process.StdinWriter, _process.AsyncStdinWriter),
    (_files.Files, _files.AsyncFiles),
    (hutch.SandboxPool, hutch.AsyncSandboxPool),
    (hutch.PtyProcess, hutch.AsyncPtyProcess),
]
# Async methods that stay plain functions because they never do I/O.
NOT_AWAITABLE = {("AsyncProcess", "poll")}
# Protocol methods that differ by design (iteration and context managers).
PROTOCOL = {"__iter__": "__aiter__", "__enter__": "__aenter__", "__exit__": "__aexit__"}


def _public(cls):
    return {n: v for n, v in inspect.getmembers(cls) if not n.startswith("_")}


def _params(fn):
    fn = fn.__func__ if isinstance(fn, classmethod) else fn
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("sync,aio", PAIRS, ids=lambda c: c.__name__)
def test_same_public_names_and_signatures(sync, aio):
    s, a = _public(sync), _public(aio)
    assert sorted(s) == sorted(a)
    for name, sv in s.items():
        av = a[name]
        assert isinstance(sv, property) == isinstance(av, property), name
        if callable(sv) and not isinstance(sv, property):
            assert _params(sv) == _params(av), f"{sync.__name__}.{name} and {aio.__name__}.{name} differ"
            if (aio.__name__, name) not in NOT_AWAITABLE:
                assert inspect.iscoroutinefunction(av), f"{aio.__name__}.{name} must be awaitable"
            assert not inspect.iscoroutinefunction(sv)
            assert (sv.__doc__ or "").strip() and (av.__doc__ or "").strip(), f"{name} needs a docstring"
    for sp, ap in PROTOCOL.items():
        assert hasattr(sync, sp) == hasattr(aio, ap), (sync.__name__, sp)
