"""The gateway as its own front door: API keys, each a
principal, idempotency keys scoped by principal and bound to their body, /health that
says when the scheduler refuses the gateway, /metrics that can move or be off."""

from __future__ import annotations

import asyncio

import pytest

from common.errors import ConfigError
from service.gateway.api_keys import PRINCIPAL_METADATA, load_api_keys
from service.gateway.scheduler_link import SchedulerLink

from .inprocess import FakeScheduler, InProcessGateway, write_model

ALICE_KEY, MALLORY_KEY, BOB_KEY = (
    "alice-key-0123456789",
    "mallory-key-0123456789",
    "bob-key-0123456789abc",
)
KEYS_TOML = f"""
[[keys]]
key = "{ALICE_KEY}"
name = "alice"
tenant = "team-a"

[[keys]]
key = "{MALLORY_KEY}"
name = "mallory"

[[keys]]
key = "{BOB_KEY}"
name = "bob"
scheduler_token = "bobs-own-scheduler-token"
"""


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("front-door-model"))


@pytest.fixture
def start(model_dir, tmp_path):
    started = []

    def factory(
        keys: str | None = KEYS_TOML, scheduler: FakeScheduler | None = None, **settings
    ) -> InProcessGateway:
        if keys is not None:
            (tmp_path / "keys.toml").write_text(keys)
            settings["api_keys_file"] = tmp_path / "keys.toml"
        started.append(InProcessGateway(model_dir, scheduler, **settings))
        return started[-1]

    yield factory
    for gateway in started:
        gateway.stop()


# ------------------------------------------------------------------ API keys


@pytest.mark.parametrize(
    "headers",
    [{}, bearer("not-a-known-key-at-all"), {"authorization": ALICE_KEY}],
    ids=["none", "unknown", "no-bearer"],
)
def test_without_a_valid_key_every_v1_route_is_a_401(start, headers):
    gateway = start()
    for answer in (
        gateway.complete(headers=headers),
        gateway.chat([{"role": "user", "content": "hi"}], headers=headers),
        gateway.request("GET", "/v1/models", headers=headers),
    ):
        assert answer.status == 401, answer.text
        assert answer.body["error"]["code"] == "invalid_api_key"
        assert answer.headers["www-authenticate"] == "Bearer"
    assert gateway.scheduler.requests == [], "nothing reached the scheduler"
    assert gateway.request("GET", "/health").status == 200, "probes need no key"


def test_a_key_is_its_principal_bound_tenant_and_scheduler_token(start):
    gateway = start()
    assert gateway.complete(headers=bearer(ALICE_KEY), user="claims-team-b").status == 200
    assert gateway.complete(headers=bearer(MALLORY_KEY), user="team-a").status == 200
    assert gateway.complete(headers=bearer(BOB_KEY)).status == 200
    alice, mallory, bob = gateway.scheduler.requests
    # A bound tenant wins over the body's user; an unbound key is its own tenant.
    assert (alice.principal, alice.tenant, alice.scheduler_token) == ("alice", "team-a", None)
    assert (mallory.principal, mallory.tenant) == ("mallory", "mallory")
    assert (bob.principal, bob.scheduler_token) == ("bob", "bobs-own-scheduler-token")


def test_the_link_sends_the_principal_and_its_own_scheduler_token(start):
    gateway = start(scheduler=FakeScheduler())
    gateway.complete(headers=bearer(BOB_KEY))
    gateway.complete(headers=bearer(ALICE_KEY))
    bob, alice = gateway.scheduler.requests

    async def metadata() -> list[dict]:
        # Made on a running loop: a grpc.aio channel needs one (an earlier asyncio.run in
        # the same process leaves no current loop).
        link = SchedulerLink("127.0.0.1:1", token="gateway-token")
        try:
            return [dict(link._metadata_for(bob)), dict(link._metadata_for(alice))]
        finally:
            await link.close()

    bobs, alices = asyncio.run(metadata())
    assert bobs == {"authorization": "Bearer bobs-own-scheduler-token", PRINCIPAL_METADATA: "bob"}
    assert alices == {"authorization": "Bearer gateway-token", PRINCIPAL_METADATA: "alice"}


@pytest.mark.parametrize(
    "text, complaint",
    [
        ('[[keys]]\nkey = "short"\nname = "a"', "at least 16 characters"),
        (f'[[keys]]\nkey = "{ALICE_KEY}"\nname = "has space"', "name must be"),
        (
            f'[[keys]]\nkey = "{ALICE_KEY}"\nname = "a"\n[[keys]]\nkey = "{ALICE_KEY}"\nname = "b"',
            "repeats an earlier key",
        ),
        (f'[[keys]]\nkey = "{ALICE_KEY}"\nname = "a"\nrole = "admin"', "unknown keys"),
        (f'[[keys]]\nkey = "{ALICE_KEY}"\nname = "a"\ntenant = "t\\u0000"', "without NUL"),
        ("keys = []", "non-empty list"),
    ],
)
def test_a_bad_keys_file_is_a_config_error_naming_the_entry(tmp_path, text, complaint):
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=complaint):
        load_api_keys(path)


# ------------------------------------------------------------------ idempotency keys


def test_an_idempotency_key_is_scoped_by_principal(start):
    gateway = start()
    key = {"idempotency-key": "alice-req-1"}
    first = gateway.complete(headers={**bearer(ALICE_KEY), **key}, prompt="alice's secret")
    other = gateway.complete(headers={**bearer(MALLORY_KEY), **key}, prompt="alice's secret")
    assert first.status == other.status == 200
    assert first.body["id"] != other.body["id"], "mallory must not reach alice's sequence"
    alice, mallory = gateway.scheduler.requests
    assert alice.request_id != mallory.request_id
    assert "alice-req-1" not in alice.request_id, "the scheduler sees a digest, not the key"


def test_an_idempotency_key_with_another_body_is_a_422_also_after_the_first_finished(start):
    gateway = start()
    key = {**bearer(ALICE_KEY), "idempotency-key": "k1"}
    first = gateway.complete(headers=key, prompt="first prompt")
    assert first.status == 200  # finished: the fake answers at once
    again = gateway.complete(headers=key, prompt="first prompt", stream=False)
    assert (again.status, again.body["id"]) == (200, first.body["id"])
    other = gateway.complete(headers=key, prompt="a different prompt")
    assert other.status == 422, other.text
    assert other.body["error"]["param"] == "Idempotency-Key"
    assert other.headers["x-should-retry"] == "false"
    assert len(gateway.scheduler.requests) == 2, "the 422 submitted nothing"


def test_without_keys_one_anonymous_principal_and_idempotency_keys_still_bind(start):
    gateway = start(keys=None)
    key = {"idempotency-key": "k1"}
    assert gateway.complete(headers=key, user="u1").status == 200
    assert gateway.complete(headers=key, user="u2").status == 422
    (request,) = gateway.scheduler.requests
    assert (request.principal, request.tenant) == ("", "u1")


# ------------------------------------------------------------------ health and metrics


def test_health_is_503_when_the_scheduler_refuses_the_gateways_credentials(start):
    refused = "the scheduler refused the gateway's credentials (check the gateway's --token)"
    gateway = start(scheduler=FakeScheduler(health_problem=refused))
    answer = gateway.request("GET", "/health")
    assert (answer.status, answer.body["status"]) == (503, "unavailable")
    assert "credentials" in answer.body["reason"]


@pytest.mark.parametrize("metrics_path", ["/internal/metrics", None])
def test_metrics_can_move_or_be_off(start, metrics_path):
    gateway = start(keys=None, metrics_path=metrics_path)
    assert gateway.request("GET", "/metrics").status == 404
    if metrics_path is not None:
        answer = gateway.request("GET", metrics_path)
        assert answer.status == 200 and "lattice_gateway_" in answer.text


def test_the_links_health_check_says_when_the_scheduler_refuses_its_token(tmp_path):
    from prometheus_client import CollectorRegistry

    from service.core import SchedulerConfig
    from service.server.app import start
    from service.settings import ServeSettings

    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[[tokens]]\ntoken = "the-gateway-token-123"\nrole = "client"\n')
    server = start(
        ServeSettings(
            host="127.0.0.1",
            port=0,
            metrics_port=0,
            auth_tokens=str(tokens),
            scheduler=SchedulerConfig(),
        ),
        CollectorRegistry(),
    )
    try:
        _check_health_answers(server.port)
    finally:
        server.stop(0)


def _check_health_answers(port: int) -> None:
    import asyncio

    async def check(token: str | None) -> str | None:
        link = SchedulerLink(f"127.0.0.1:{port}", token=token)
        try:
            return await link.check_health()
        finally:
            await link.close()

    assert asyncio.run(check("the-gateway-token-123")) is None
    for wrong in ("a-token-it-does-not-know", None):
        problem = asyncio.run(check(wrong))
        assert problem is not None and "refused the gateway's credentials" in problem
