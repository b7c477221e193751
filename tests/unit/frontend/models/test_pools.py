"""The global router's pools (turbine/frontend/models/pools.py): `--pool` parsed and checked, naming the flag."""

from __future__ import annotations

import pytest

from turbine.config import DiscoveryConfig
from turbine.frontend.args import parse_frontend_args
from turbine.frontend.models.pools import PoolConfig, parse_pool


def test_a_pool_in_this_frontends_discovery_or_in_another():
    assert parse_pool("east=ns-east") == PoolConfig("east", "ns-east")
    assert parse_pool("west=ns_w@file:/srv/disc", 5.0) == PoolConfig(
        "west", "ns_w", DiscoveryConfig(backend="file", file_dir="/srv/disc", ttl=5.0))
    etcd = parse_pool("far=prod@etcd:10.0.0.1:2379,http://10.0.0.2:2379")
    assert etcd.discovery.backend == "etcd" and etcd.discovery.etcd_endpoints == ("10.0.0.1:2379", "10.0.0.2:2379")


@pytest.mark.parametrize("argv,words", [
    (["--pool", "east"], "expected NAME=NAMESPACE"),
    (["--pool", "a=b/c"], "must be letters, digits"),
    (["--pool", "a=ns@zookeeper:x"], "must be file:DIR or etcd:HOST:PORT"),
    (["--pool", "a=x", "--router-mode", "kv"], "one pool is a plain frontend"),
    (["--pool", "a=x", "--pool", "a=y", "--router-mode", "kv"], "a pool name is given twice"),
    (["--pool", "a=x", "--pool", "b=x", "--router-mode", "kv"], "the same namespace in the same discovery"),
    (["--pool", "a=x", "--pool", "b=y"], "add --router-mode kv"),
    (["--pool", "a=x", "--pool", "b=y", "--router-mode", "kv", "--namespace", "x"], "drop --namespace"),
])
def test_pools_that_cannot_work_are_refused_naming_the_flag(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        parse_frontend_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--pool" in err and words in err


def test_two_pools_make_a_global_router():
    cfg = parse_frontend_args(["--pool", "a=x", "--pool", "b=y@file:/tmp/elsewhere", "--router-mode", "kv"])
    assert [p.name for p in cfg.pools] == ["a", "b"] and cfg.pools[1].discovery.file_dir == "/tmp/elsewhere"
