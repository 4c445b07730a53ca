"""The OpenAI surface as clients use it, the gateway's part: HEAD
where GET is served, GET /v1/models/{id}, a body limit answered at once, tokenization
that never delays other requests, error params that name the field, OpenAI's ranges."""

from __future__ import annotations

import json
import random
import socket
import string
import threading
import time

import pytest

from .inprocess import LOOPBACK, MODEL, InProcessGateway, write_model

MAX_BODY_BYTES = 6 * 1024 * 1024


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    started = InProcessGateway(
        write_model(tmp_path_factory.mktemp("surface-model")), max_body_bytes=MAX_BODY_BYTES
    )
    yield started
    started.stop()


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models", f"/v1/models/{MODEL}"])
def test_head_is_served_where_get_is(gateway, path):
    get, head = gateway.request("GET", path), gateway.request("HEAD", path)
    assert (get.status, head.status) == (200, 200)
    assert head.text == ""


def test_a_model_is_served_by_its_id_and_another_id_is_a_404(gateway):
    answer = gateway.request("GET", f"/v1/models/{MODEL}")
    assert (answer.body["id"], answer.body["object"]) == (MODEL, "model")
    other = gateway.request("GET", "/v1/models/gpt-4")
    assert (other.status, other.body["error"]["code"]) == (404, "model_not_found")


def _raw_exchange(gateway: InProcessGateway, head: bytes, body: bytes = b"") -> bytes:
    """Send `head`, then `body` from another thread (the server may stop reading it), and
    read the answer until the server closes."""
    with socket.create_connection((LOOPBACK, gateway.port), timeout=10) as sock:
        sock.sendall(head)

        def send_body() -> None:
            try:
                sock.sendall(body)
            except OSError:
                pass  # the server answered and closed first

        sender = threading.Thread(target=send_body, daemon=True)
        sender.start()
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
                if b"\r\n\r\n" in answer and b"--max-body-bytes" in answer:
                    break
        except ConnectionError:
            pass
        return answer


def test_a_body_over_the_limit_is_a_413_before_it_is_sent(gateway):
    started = time.perf_counter()
    answer = _raw_exchange(
        gateway,
        (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {10 * 1024 * 1024}\r\n\r\n"
        ).encode(),
    )  # and not one body byte
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"--max-body-bytes" in answer
    assert time.perf_counter() - started < 2.0


def test_a_chunked_body_over_the_limit_is_a_413(gateway):
    piece = b"x" * (1024 * 1024)
    chunks = b"".join(f"{len(piece):x}\r\n".encode() + piece + b"\r\n" for _ in range(8))
    answer = _raw_exchange(
        gateway,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n",
        b'5\r\n{"a":\r\n' + chunks + b"0\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


# 10.8 MB: the outside probe's completion request, over the 6 MiB limit here.
BIG_PROMPT = "word " * (10_800_000 // 5)


def test_a_client_that_writes_the_whole_body_before_reading_reads_the_413(tmp_path):
    """Regression (outside probe): urllib (as requests and httpx) writes a 10.8 MB body
    whole before it reads; the gateway answered and closed while the body was arriving,
    and the client saw `Connection reset by peer`, not the 413."""
    import urllib.error
    import urllib.request

    # A gateway of its own: the drain must not be helped by earlier tests' connections.
    started_gateway = InProcessGateway(write_model(tmp_path), max_body_bytes=MAX_BODY_BYTES)
    try:
        body = json.dumps({"model": MODEL, "prompt": BIG_PROMPT, "max_tokens": 1}).encode()
        for _ in range(3):
            request = urllib.request.Request(
                started_gateway.base_url + "/v1/completions",
                data=body,
                headers={"content-type": "application/json"},
            )
            started = time.perf_counter()
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=10)
            assert refused.value.code == 413
            assert b"--max-body-bytes" in refused.value.read()
            assert time.perf_counter() - started < 3.0
    finally:
        started_gateway.stop()


def test_the_openai_client_gets_the_413_at_once_and_does_not_retry(tmp_path):
    openai = pytest.importorskip("openai")
    started_gateway = InProcessGateway(write_model(tmp_path), max_body_bytes=MAX_BODY_BYTES)
    try:
        # No retries: the first upload's answer must be the 413 (a reset would be an
        # APIConnectionError here; with retries, the SDK would upload the body again).
        client = openai.OpenAI(
            base_url=started_gateway.base_url + "/v1", api_key="x", max_retries=0
        )
        for _ in range(3):
            started = time.perf_counter()
            with pytest.raises(openai.APIStatusError) as refused:
                client.completions.create(model=MODEL, prompt=BIG_PROMPT, max_tokens=1)
            assert refused.value.status_code == 413
            assert time.perf_counter() - started < 3.0
        assert started_gateway.scheduler.requests == []
    finally:
        started_gateway.stop()


def test_a_long_prompt_does_not_delay_another_request(gateway):
    # ~2.3 MB of text: tokenizing it takes seconds of CPU, and it ends in a 400 (longer
    # than max_model_len). Meanwhile GET /v1/models answers at once: the tokenizer runs on
    # a thread, without the GIL.
    rng = random.Random(0)
    prompt = " ".join(
        "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 9))) for _ in range(350_000)
    )
    result = {}

    def long_request() -> None:
        started = time.perf_counter()
        result["answer"] = gateway.complete(prompt=prompt, timeout=300)
        result["seconds"] = time.perf_counter() - started

    # The longest time between two answers, from the start (the gateway runs in this
    # process: while its tokenizer held the GIL, this thread could not even wake up).
    slowest, last = 0.0, time.perf_counter()
    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(0.3)  # the body is sent and being read or tokenized
    while thread.is_alive():
        assert gateway.request("GET", "/v1/models", timeout=60).status == 200
        now = time.perf_counter()
        slowest, last = max(slowest, now - last), now
        time.sleep(0.02)
    thread.join()
    assert result["answer"].status == 400 and "prompt" in result["answer"].text
    assert result["seconds"] > 1.5, "the prompt must take long enough to show anything"
    # On the loop, a GET waited for the whole tokenization; allow for a loaded machine.
    assert slowest < result["seconds"] / 3, (
        f"no GET /v1/models answered for {slowest:.2f} s while a long prompt was tokenized "
        f"({result['seconds']:.2f} s)"
    )


@pytest.mark.parametrize(
    "path, body, param",
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "wizard", "content": "hi"}]},
            "messages[0].role",
        ),
        ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "presence_penalty": -3}, "presence_penalty"),
        ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),  # not "prompt.str"
        ("/v1/completions", {"prompt": [1, "x"]}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": 5}]},
            "messages[0].content",
        ),
    ],
)
def test_values_outside_openais_ranges_are_400s_naming_the_field(gateway, path, body, param):
    answer = gateway.request("POST", path, {"model": MODEL, **body})
    assert answer.status == 400, answer.text
    assert answer.body["error"]["param"] == param, answer.body


def test_top_p_0_is_accepted_as_the_most_likely_token_alone(gateway):
    before = len(gateway.scheduler.requests)
    assert gateway.complete(top_p=0, temperature=0.9).status == 200
    (request,) = gateway.scheduler.requests[before:]
    assert request.temperature == 0.0, "top_p 0 means greedy (the wire's top_p 0 is off)"


def test_the_developer_role_is_the_templates_system_role(gateway):
    before = len(gateway.scheduler.requests)
    answer = gateway.chat(
        [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    )
    assert answer.status == 200, answer.text
    (request,) = gateway.scheduler.requests[before:]
    files = gateway.gateway.files
    assert files.decode(list(request.prompt_token_ids)).startswith("system\nBe brief.")
    assert json.dumps(answer.body)  # a whole answer
