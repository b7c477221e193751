"""The local connector's config checks itself and names what is wrong."""

import pytest

from turbine.config import ConfigError, DiscoveryConfig
from turbine.planner.connector import make_connector
from turbine.planner.connectors.local import LocalConnector, LocalConnectorConfig, LocalRole


def test_flags_the_connector_sets_itself_are_refused_in_a_roles_args():
    with pytest.raises(ConfigError, match=r"LocalRole.args: --num-workers, --system-port are set by the local"):
        LocalRole("mocker", ("--num-workers", "2", "--system-port=9000"))
    with pytest.raises(ConfigError, match="LocalRole.engine: choose from vllm, mocker"):
        LocalRole("sglang")


def test_roles_must_be_known_and_present():
    with pytest.raises(ConfigError, match="unknown role"):
        LocalConnectorConfig(roles={"encode": LocalRole()})
    with pytest.raises(ConfigError, match="name at least one role"):
        LocalConnectorConfig(roles={})
    with pytest.raises(ConfigError, match="drain_timeout: must be >= 0"):
        LocalConnectorConfig(roles={"agg": LocalRole()}, drain_timeout=-1)


def test_from_dict_reads_the_planner_config_section_and_refuses_unknown_keys():
    cfg = LocalConnectorConfig.from_dict(
        {"roles": {"prefill": {"engine": "vllm", "args": ["--enforce-eager"], "env": {"VLLM_CPU_KVCACHE_SPACE": 2}}},
         "drain_timeout": 5}, DiscoveryConfig(backend="file", file_dir="/tmp/x"))
    assert cfg.roles["prefill"] == LocalRole("vllm", ("--enforce-eager",), {"VLLM_CPU_KVCACHE_SPACE": "2"})
    assert cfg.drain_timeout == 5 and cfg.discovery.file_dir == "/tmp/x"
    with pytest.raises(ConfigError, match="unknown local connector option"):
        LocalConnectorConfig.from_dict({"roles": {"agg": {}}, "replicas": 3})
    with pytest.raises(ConfigError, match="role agg: unknown key"):
        LocalConnectorConfig.from_dict({"roles": {"agg": {"flags": []}}})


async def test_it_is_chosen_by_name_and_refuses_roles_it_has_no_flags_for(tmp_path):
    class PlannerConfig:  # the planner's config carries the connector's section and discovery
        connector_options = {"roles": {"agg": {}}, "log_dir": str(tmp_path)}
        discovery = DiscoveryConfig(backend="file", file_dir=str(tmp_path / "d"))

    conn = make_connector("local", PlannerConfig())
    assert isinstance(conn, LocalConnector)
    await conn.start()
    try:
        with pytest.raises(ValueError, match="no launch flags for role.* decode"):
            await conn.set_replicas({"decode": 1}, decision_id=1)
        assert await conn.current_replicas() == {"agg": 0}
    finally:
        await conn.close()


def test_options_given_as_flags_are_strings_and_are_converted():
    from turbine.planner.connectors.kubernetes import KubernetesConnectorConfig
    from turbine.planner.connectors.virtual import VirtualConnectorConfig

    cfg = LocalConnectorConfig.from_dict({"roles": {"agg": {}}, "drain_timeout": "5", "adopt": "false"})
    assert (cfg.drain_timeout, cfg.adopt) == (5.0, False)
    assert VirtualConnectorConfig.from_dict({"ack_timeout": "30"}).ack_timeout == 30.0
    k = KubernetesConnectorConfig.from_dict({"deployments": {"decode": "d"}, "status_port": "8081", "namespace": "n"})
    assert k.status_port == 8081
