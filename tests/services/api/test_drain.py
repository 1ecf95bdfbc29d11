"""services/api/drain.py: a draining API replica is not ready at once, refuses new requests with a 503,
lets the streams in flight finish (or cuts them in-band at the deadline), then its uvicorn stops.
A real uvicorn (`api_server`) in a thread over a slowly streaming scripted backend; the drain is
started as SIGTERM starts it (`handle_exit`). The real signal to a real process: test_deployment.py."""
from __future__ import annotations

import json
import signal
import threading
import time
from contextlib import contextmanager

import httpx

from specloop.services.api.app import api_server
from specloop.services.api.drain import CUT_GRACE_S, Drain
from tests.api_helpers import MODEL, Streamer, scripted, scripted_app
from tests.redis_helpers import free_port


@contextmanager
def draining_server(app, drain_timeout: float):
    """`api_server` for `app` in a thread; yields (base URL, server); the thread must end by itself."""
    port = free_port()
    server = api_server(app, "127.0.0.1", port, drain_timeout)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", server, thread
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_drain_is_over_when_nothing_is_in_flight_and_cuts_what_is_left_at_its_deadline(monkeypatch):
    drain, cut = Drain(), []
    token = drain.enter(lambda: cut.append("a"))
    assert not drain.tick() and not drain.draining
    drain.start(timeout_s=60)
    assert drain.draining and not drain.tick() and cut == []
    drain.leave(token)
    assert drain.tick()
    late = Drain()
    late.enter(lambda: cut.append("b"))
    late.start(timeout_s=0)
    assert not late.tick() and cut == ["b"]  # cut at once; over after the grace
    monkeypatch.setattr("specloop.services.api.drain.CUT_GRACE_S", 0)
    assert late.tick() and cut == ["b"]


def test_sigterm_makes_ready_503_refuses_new_requests_and_lets_the_stream_finish(tiny_pair):
    backend = scripted(tiny_pair[0], "Sure, here is an example of how you could write", delay_s=0.1)
    with draining_server(scripted_app(backend), drain_timeout=20) as (url, server, thread):
        assert httpx.get(url + "/ready").status_code == 200
        stream = Streamer(url)
        stream.start()
        stream.wait_for(2)
        server.handle_exit(signal.SIGTERM, None)
        t0 = time.monotonic()
        ready = httpx.get(url + "/ready")
        assert ready.status_code == 503 and ready.json() == {"status": "draining"}
        assert time.monotonic() - t0 < 1.0
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
        assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "overloaded_error",
                                     "param": None, "code": "shutting_down"}
        assert httpx.get(url + "/health").status_code == 200  # alive, just not taking work
        assert thread.is_alive()  # still serving the stream
        stream.join(20)
        thread.join(10)
        assert not thread.is_alive(), "the server did not stop after the drain"
    assert stream.status == 200 and stream.events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in stream.events[:-1])
    assert text == backend.tokenizer.decode(backend.tokens) and backend.open_streams == 0


def test_a_stream_still_running_at_the_drain_deadline_ends_in_band_then_done(tiny_pair):
    backend = scripted(tiny_pair[0], "Sure, here is an example of how you could write", delay_s=0.2)
    with draining_server(scripted_app(backend), drain_timeout=0.5) as (url, server, thread):
        stream = Streamer(url)
        stream.start()
        stream.wait_for(1)
        server.handle_exit(signal.SIGTERM, None)
        stream.join(10)
        thread.join(10)
        assert not thread.is_alive()
    *_, error, done = stream.events
    assert done == "[DONE]" and json.loads(error)["error"]["code"] == "shutting_down"
    assert len(stream.events) < len(backend.tokens) and backend.open_streams == 0


def test_a_second_signal_cuts_what_is_in_flight_in_band_and_a_third_stops_at_once(tiny_pair):
    backend = scripted(tiny_pair[0], "Sure, here is an example of how you could write", delay_s=0.5)
    with draining_server(scripted_app(backend), drain_timeout=30) as (url, server, thread):
        stream = Streamer(url)
        stream.start()
        stream.wait_for(1)
        server.handle_exit(signal.SIGTERM, None)
        t0 = time.monotonic()
        server.handle_exit(signal.SIGINT, None)
        stream.join(5)
        thread.join(5)
        assert not thread.is_alive() and time.monotonic() - t0 < CUT_GRACE_S + 1.5  # not the 30 s drain
    *_, error, done = stream.events
    assert done == "[DONE]" and json.loads(error)["error"]["code"] == "shutting_down"  # cut in-band, not dropped
    assert backend.open_streams == 0

    backend = scripted(tiny_pair[0], "Sure, here is an example of how you could write", delay_s=0.5)
    with draining_server(scripted_app(backend), drain_timeout=30) as (url, server, thread):
        stream = Streamer(url)
        stream.start()
        stream.wait_for(1)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGINT):
            server.handle_exit(sig, None)
        thread.join(5)
        assert not thread.is_alive() and server.force_exit
    stream.join(5)
