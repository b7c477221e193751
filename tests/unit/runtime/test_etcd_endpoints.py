"""--etcd-endpoints → the gRPC target of the etcd client: IP literals as a round-robin list, one
DNS name through gRPC's DNS resolver (etcd3aio alone took IPv4 literals only, so a Kubernetes or
compose service name failed at start), several names refused naming the flag."""

import pytest

from turbine.config import ConfigError, DiscoveryConfig
from turbine.runtime.discovery.endpoints import EndpointError, etcd_grpc_target


@pytest.mark.parametrize(("endpoints", "target"), [
    (["127.0.0.1:2379"], "ipv4:127.0.0.1:2379"),
    (["10.0.0.1:2379", "10.0.0.2:2379"], "ipv4:10.0.0.1:2379,10.0.0.2:2379"),
    (["localhost:2379"], "ipv4:127.0.0.1:2379"),  # as etcd3aio did: IPv4, no resolver ambiguity
    (["[::1]:2379", "[fd00::2]:2379"], "ipv6:[::1]:2379,[fd00::2]:2379"),
    (["turbine-etcd:2379"], "dns:///turbine-etcd:2379"),
    (["etcd.turbine.svc.cluster.local:2379"], "dns:///etcd.turbine.svc.cluster.local:2379"),
])
def test_targets(endpoints, target):
    assert etcd_grpc_target(endpoints) == target


@pytest.mark.parametrize("endpoints", [["etcd-0:2379", "etcd-1:2379"], ["etcd:2379", "10.0.0.1:2379"],
                                       ["10.0.0.1:2379", "[::1]:2379"], ["etcd"], ["etcd:port"], []])
def test_what_grpc_cannot_dial_is_refused(endpoints):
    with pytest.raises(EndpointError):
        etcd_grpc_target(endpoints)


def test_the_config_names_the_flag():
    assert DiscoveryConfig(backend="etcd", etcd_endpoints=("turbine-etcd:2379",)).etcd_endpoints
    with pytest.raises(ConfigError, match=r"--etcd-endpoints.*one DNS name"):
        DiscoveryConfig(backend="etcd", etcd_endpoints=("etcd-0:2379", "etcd-1:2379"))
    DiscoveryConfig(backend="file", etcd_endpoints=("etcd-0:2379", "etcd-1:2379"))  # not used: not checked
