"""attach()'s options are checked where they are given: a bad one raises at construction, with the option,
the value and what is allowed in one line (issue 23: agent='bogus' was accepted and recorded nothing)."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from phasescope.agent import attach  # noqa: E402
from phasescope.agent.records.address import parse_address  # noqa: E402

BAD = [
    ({"agent": "bogus"}, r"attach\(address='bogus'\): address 'bogus': expected unix:/path/agent.sock"),
    ({"address": "bogus"}, "expected unix:/path/agent.sock, tcp:HOST:PORT or a socket path"),
    ({"address": "tcp:127.0.0.1:99999"}, "port 99999 is outside 0-65535"),
    ({"address": "tcp:127.0.0.1"}, "expected tcp:HOST:PORT"),
    ({"address": "unix:/" + "x" * 120}, "at most 107"),
    ({"gpu_budget": 2.0}, r"attach\(gpu_budget=2.0\): must be > 0 and <= 1"),
    ({"gpu_budget": 0.0}, "must be > 0 and <= 1"),
    ({"gpu_min_rate": -0.1}, "must be 0 to 1"),
    ({"buffer_records": 3}, r"attach\(buffer_records=3\): must be 16 to 67,108,864"),
    ({"flush_interval_s": 0}, "must be 0.001 to 60 s"),
    ({"poll_interval_s": 100}, "must be 0.001 to 10 s"),
    ({"event_pool_size": 0}, "must be 1 to 65,536"),
    ({"rank": -1, "world_size": 2}, r"attach\(rank=-1\): must be >= 0"),
    ({"world_size": 0}, r"attach\(world_size=0\): must be >= 1"),
]


@pytest.mark.parametrize("options,match", BAD, ids=[next(iter(o)) + "-" + str(i) for i, (o, _) in enumerate(BAD)])
def test_a_bad_option_raises_at_construction(options, match):
    model = torch.nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError, match=match):
            attach(model, connect=False, **options)


def test_good_addresses_still_parse():
    assert str(parse_address("unix:/run/p/agent.sock")) == "unix:/run/p/agent.sock"
    assert str(parse_address("/run/p/agent.sock")) == "unix:/run/p/agent.sock"
    assert str(parse_address("./agent.sock")) == "unix:./agent.sock"
    assert str(parse_address("tcp:127.0.0.1:0")) == "tcp:127.0.0.1:0"  # a listener picks a port
    assert str(parse_address("tcp:127.0.0.1:65535")) == "tcp:127.0.0.1:65535"
    probe = attach(torch.nn.Linear(2, 2), address="tcp:127.0.0.1:7701", connect=False)
    probe.close()
