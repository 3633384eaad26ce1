"""--allowed-bootstrap: which bootstrap servers a decode may be sent to."""

from __future__ import annotations

import pytest

from tandem.common.config import ConfigError, parse_endpoints
from tandem.services.decode.allow_list import BootstrapAllowList


def test_addresses_networks_and_names_match_only_their_ports():
    allowed = BootstrapAllowList(parse_endpoints("10.0.0.5:8998, 10.1.0.0/16:8998,localhost:9000,[::1]:7000"))
    assert allowed.allows("10.0.0.5", 8998) and not allowed.allows("10.0.0.5", 8999)
    assert allowed.allows("10.1.44.3", 8998) and not allowed.allows("10.2.0.1", 8998)
    assert allowed.allows("localhost", 9000)
    assert allowed.allows("127.0.0.1", 9000)  # what localhost resolves to: the router names prefills by IP
    assert not allowed.allows("127.0.0.1", 8998) and not allowed.allows("evil.example", 9000)
    assert allowed.allows("::1", 7000) and allowed.allows("[::1]", 7000)


@pytest.mark.parametrize("text", ["", "10.0.0.5", "host:port", "host:0", ":8998", "a:1,b"])
def test_bad_entries_are_config_errors_naming_the_flag(text):
    with pytest.raises(ConfigError, match="--allowed-bootstrap"):
        parse_endpoints(text)


def test_the_flag_exists_on_decode_only():
    from tandem.common.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["decode", "--model", "/m", "--allowed-bootstrap", "a:1,b:2"])
    from tandem.common.config import TransferFlags
    from tandem.common.flags import from_flags

    assert from_flags(TransferFlags, args).allowed_bootstrap == ("a:1", "b:2")
    with pytest.raises(SystemExit):
        parser.parse_args(["prefill", "--model", "/m", "--allowed-bootstrap", "a:1"])
