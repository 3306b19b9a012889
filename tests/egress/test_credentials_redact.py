"""The broker's redaction of a stream, as a pure function: every split of the secret, lengths kept."""

from __future__ import annotations

import pytest

from hutch.sandbox._host.egress.broker import Budget, Redactor

SECRET = b"sk-live-0123456789abcdef"
HEADER = b"Bearer " + SECRET


def run(chunks):
    r = Redactor([SECRET, HEADER])
    out = b"".join(r.feed(c) for c in chunks) + r.flush()
    return out


@pytest.mark.parametrize("at", range(0, 60, 1))
def test_the_secret_is_replaced_wherever_the_stream_splits(at):
    body = b'{"echo": "Authorization: ' + HEADER + b'", "again": "' + SECRET + b'"}'
    out = run([body[:at], body[at:]])
    assert SECRET not in out and len(out) == len(body)
    assert out == body.replace(HEADER, b"*" * len(HEADER)).replace(SECRET, b"*" * len(SECRET))


def test_byte_by_byte_and_a_prefix_at_the_end_is_held_then_let_go():
    body = b"x" * 10 + SECRET + b"y" * 3
    assert run([bytes([c]) for c in body]) == b"x" * 10 + b"*" * len(SECRET) + b"yyy"
    r = Redactor([SECRET])
    assert r.feed(b"ok sk-li") == b"ok " and r.held == b"sk-li"   # could begin the secret: held
    assert r.feed(b"ne") == b"sk-line" and r.held == b""            # it did not
    assert r.feed(b"plain") == b"plain"


def test_a_budget_counts_a_sliding_minute():
    b = Budget(2, 100)
    assert b.take_request(10) is None and b.take_request(10) is None
    assert "2 requests per minute" in b.take_request(0)
    b = Budget(None, 100)
    assert b.take_request(101) is not None and b.take_request(60) is None
    assert b.add(60) and not b.add(50) and "100 bytes" in b.take_request(0)


def test_responses_are_counted_by_their_framing_and_kept_in_bounded_memory():
    from hutch.sandbox._host.egress.broker import Responses

    r = Responses()
    r.methods.extend(["GET", "HEAD", "GET", "GET"])
    stream = (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
              b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n"
              b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
    for i in range(len(stream)):
        r.feed(stream[i:i + 1])
    assert (r.done, list(r.methods), r.broken) == (3, ["GET"], False)
    r.feed(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
    for _ in range(100):
        r.feed(b"x" * 65536)          # a body that ends with the connection is not kept
    assert len(r._buf) < 65536 and r.done == 3


def test_a_header_or_variable_name_with_a_final_newline_is_refused():
    import hutch

    with pytest.raises(hutch.NetworkPolicyError):
        hutch.Secret.from_value("s3cr3t-value", header="Authorization\n")
    with pytest.raises(hutch.NetworkPolicyError):
        hutch.Secret.from_env("EXAMPLE_KEY\n")
