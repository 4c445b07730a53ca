"""Scheduler address lists: clients spread calls over replicas, workers move along them."""

from __future__ import annotations

import pytest

from common.targets import ROUND_ROBIN, TargetError, channel_target, expand, split


def test_a_single_address_is_used_as_it_is():
    assert channel_target("127.0.0.1:50051") == ("127.0.0.1:50051", [])


def test_a_list_becomes_one_round_robin_channel_over_every_address():
    target, options = channel_target("127.0.0.1:1, localhost:2")
    assert target.startswith("ipv4:127.0.0.1:1,") or target.startswith("ipv6:")
    assert options == [ROUND_ROBIN]


def test_a_dns_name_balances_round_robin():
    assert channel_target("dns:///localhost:7") == ("dns:///localhost:7", [ROUND_ROBIN])


def test_workers_get_every_address_of_a_dns_name_in_order():
    assert expand("dns:///127.0.0.1:7,10.0.0.2:8") == ["127.0.0.1:7", "10.0.0.2:8"]


@pytest.mark.parametrize(
    "bad, message",
    [
        ("", "no scheduler address"),
        ("127.0.0.1:1,nonsense", "'nonsense' is not HOST:PORT"),
        ("127.0.0.1:1,[::1]:2", "mixes IPv4 and IPv6"),
    ],
)
def test_an_unusable_list_is_one_line_naming_the_entry(bad, message):
    with pytest.raises(TargetError, match=message.replace("[", r"\[")):
        channel_target(bad)


def test_split_ignores_spaces_and_empty_entries():
    assert split(" a:1 ,, b:2 ") == ["a:1", "b:2"]
