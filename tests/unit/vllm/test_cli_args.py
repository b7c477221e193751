"""Invalid or conflicting flags exit with a message that names the flag."""

import pytest

from turbine.vllm.args import parse_worker_args


@pytest.mark.parametrize("argv,flag", [
    (["--endpoint-types", "chat,embeddings"], "--endpoint-types"),
    (["--custom-jinja-template", "/no/such/file.jinja"], "--custom-jinja-template"),
    (["--system-port", "70000"], "--system-port"),
    (["--migration-limit", "-1"], "--migration-limit"),
    (["--dyn-tool-call-parser", "nope"], "--dyn-tool-call-parser"),
    (["--tool-call-parser", "deepseek_r1"], "--dyn-tool-call-parser"),
    (["--dyn-reasoning-parser", "hermes"], "--dyn-reasoning-parser"),
    (["--reasoning-parser", "nope"], "--dyn-reasoning-parser"),
    (["--dyn-reasoning-parser", "qwen3", "--reasoning-parser", "deepseek_r1"], "--reasoning-parser"),
    (["--reasoning-parser-plugin", "/tmp/p.py"], "--reasoning-parser-plugin"),
    (["--endpoint", "a.b"], "--endpoint"),
    (["--namespace", "bad/ns"], "--namespace"),
    (["--discovery-backend", "zookeeper"], "--discovery-backend"),
    (["--served-model-name", "a", "b"], "--served-model-name"),
    (["--model", "/no/such/model/folder", "--max-model-len", "abc"], "--max-model-len"),
])
def test_bad_worker_flags_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as info:
        parse_worker_args(argv)
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


def test_migration_limit_goes_into_the_model_card():
    cfg = parse_worker_args(["--migration-limit", "2", "--enforce-eager"])
    card = cfg.model_card("i1", engine="vllm", tokenizer_path="/m", context_length=2048, kv_block_size=16,
                            total_kv_blocks=10, max_num_seqs=4, max_num_batched_tokens=2048)
    assert card.migration_limit == 2


def test_defaults_and_dyn_style_endpoint(tmp_path):
    cfg = parse_worker_args(["--endpoint", "dyn://ns1.comp1.gen1", "--enforce-eager"])
    assert (cfg.namespace, cfg.component, cfg.endpoint) == ("ns1", "comp1", "gen1")
    assert cfg.served_model_name == "smollm2-135m-instruct"
    assert cfg.engine_args.enable_prefix_caching is True  # on unless turned off
    off = parse_worker_args(["--no-enable-prefix-caching"])
    assert off.engine_args.enable_prefix_caching is False
    assert cfg.discovery.backend == "file"


def test_parser_flags_and_vllm_spellings():
    """The parsers go to the model card; vLLM's --reasoning-parser is the frontend's parser only:
    the engine does not get it (it would confine structured outputs to after `</think>`)."""
    cfg = parse_worker_args(["--dyn-tool-call-parser", "hermes", "--dyn-reasoning-parser", "qwen3"])
    assert (cfg.tool_call_parser, cfg.reasoning_parser) == ("hermes", "qwen3")
    assert not cfg.engine_args.reasoning_parser
    cfg = parse_worker_args(["--tool-call-parser", "mistral", "--reasoning-parser", "deepseek_r1"])
    assert (cfg.tool_call_parser, cfg.reasoning_parser) == ("mistral", "deepseek_r1")
    assert not cfg.engine_args.reasoning_parser
    card = cfg.model_card("i", engine="vllm", tokenizer_path="/t", context_length=8, kv_block_size=1,
                          total_kv_blocks=1, max_num_seqs=1, max_num_batched_tokens=1)
    assert (card.tool_call_parser, card.reasoning_parser) == ("mistral", "deepseek_r1")


def test_turbine_cli_serve_rejects_bad_port(capsys):
    from turbine.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--http-port", "0"])
    assert "--http-port" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--is-prefill-worker"], "--connector nixl"),
    (["--disaggregation-mode", "decode"], "--connector nixl"),
    (["--is-prefill-worker", "--is-decode-worker", "--connector", "nixl"],
     "--is-prefill-worker and --is-decode-worker contradict"),
    (["--disaggregation-mode", "agg", "--is-decode-worker", "--connector", "nixl"], "contradict"),
    (["--disaggregation-mode", "both"], "--disaggregation-mode"),
    (["--connector", "nixl", "--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'],
     "--connector and --kv-transfer-config"),
    (["--connector", "nixl,none"], "--connector none"),
    (["--connector", "nixl,nixl"], "named twice"),
    (["--connector", "kvbm"], "--connector kvbm needs a tier"),
    (["--kv-host-cache-gb", "1"], "--kv-host-cache-gb: the KV tiers need --connector kvbm"),
    (["--connector", "nixl", "--kv-disk-cache-dir", "/tmp/x"],
     "--kv-disk-cache-dir: the KV tiers need --connector kvbm"),
    (["--connector", "kvbm", "--kv-disk-cache-gb", "1"], "--kv-disk-cache-gb and --kv-disk-cache-dir go together"),
    (["--connector", "kvbm", "--kv-host-cache-gb", "0"], "--kv-host-cache-gb must be > 0"),
    (["--connector", "kvbm", "--kv-host-cache-gb", "1", "--kv-disk-min-uses", "2"],
     "--kv-disk-min-uses filters the disk tier: it needs --kv-disk-cache-gb"),
    (["--connector", "kvbm", "--kv-disk-cache-gb", "1", "--kv-disk-cache-dir", "/tmp/x", "--kv-disk-min-uses", "0"],
     "--kv-disk-min-uses must be >= 1"),
    (["--kv-disk-min-uses", "2"], "--kv-disk-min-uses: the KV tiers need --connector kvbm"),
    (["--connector", "offload"], "only supported on CUDA-alike and XPU GPUs"),
    (["--connector", "lmcache"], "--connector lmcache cannot run on the vLLM CPU build"),
    (["--connector", "kvbm", "--kv-shared-cache-dir", "/tmp/x"],
     "--kv-shared-cache-gb and --kv-shared-cache-dir go together"),
    (["--connector", "kvbm", "--kv-shared-cache-gb", "-1", "--kv-shared-cache-dir", "/tmp/x"],
     "--kv-shared-cache-gb must be > 0"),
    (["--connector", "kvbm", "--kv-disk-cache-gb", "1", "--kv-disk-cache-dir", "/tmp/x", "--kv-shared-cache-gb", "1",
      "--kv-shared-cache-dir", "/tmp/x/"], "--kv-disk-cache-dir and --kv-shared-cache-dir must differ"),
    (["--kv-shared-cache-gb", "1"], "--kv-shared-cache-gb: the KV tiers need --connector kvbm"),
    (["--connector", "kvbm,nixl", "--kv-host-cache-gb", "1"], "--connector kvbm with nixl is for prefill workers"),
    (["--is-prefill-worker", "--connector", "kvbm", "lmcache", "--kv-host-cache-gb", "1"],
     "--connector kvbm combines with nixl only (on a prefill worker), not with lmcache"),
    (["--connector", "kvbm", "--kv-host-cache-gb", "1", "--tensor-parallel-size", "2"], "--connector kvbm: not with"),
    (["--is-decode-worker", "--connector", "kvbm", "--kv-host-cache-gb", "1"],
     "--connector kvbm is not for decode workers"),
    (["--is-decode-worker", "--connector", "nixl", "kvbm", "--kv-host-cache-gb", "1"],
     "--connector kvbm is not for decode workers"),
    (["--is-prefill-worker", "--connector", "kvbm", "--kv-host-cache-gb", "1"],
     "a prefill worker needs nixl too (--connector kvbm nixl)"),
    (["--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_both"}', "--kv-host-cache-gb", "1"],
     "--kv-host-cache-gb: the KV tiers need --connector kvbm"),
    (["--connector", "rdma"], "--connector"),
    (["--is-decode-worker", "--connector", "nixl", "--kv-transfer-timeout", "0"], "--kv-transfer-timeout"),
    (["--event-plane", "kafka"], "--event-plane"),
    (["--nats-server", "http://x"], "--nats-server"),
    (["--kv-events-buffer", "-1"], "--kv-events-buffer"),
    (["--graceful-shutdown-timeout", "-1"], "--graceful-shutdown-timeout"),
])
def test_bad_disaggregation_flags_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse_worker_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_disaggregation_roles_and_connectors():
    prefill = parse_worker_args(["--is-prefill-worker", "--connector", "nixl"])
    assert (prefill.disaggregation_mode, prefill.component) == ("prefill", "prefill")
    kv = prefill.engine_args.kv_transfer_config
    assert (kv.kv_connector, kv.kv_role, kv.kv_buffer_device) == ("NixlConnector", "kv_both", "cpu")
    assert kv.kv_connector_module_path == "turbine.vllm.nixl_cpu"  # NIXL without its busy progress thread
    assert kv.kv_load_failure_policy == "fail"

    decode = parse_worker_args(["--disaggregation-mode", "decode", "--connector", "nixl"])
    assert (decode.disaggregation_mode, decode.component) == ("decode", "backend")
    # A decode worker that cannot pull the KV computes the prompt instead of failing the request.
    assert decode.engine_args.kv_transfer_config.kv_load_failure_policy == "recompute"

    agg = parse_worker_args([])
    assert agg.disaggregation_mode == "agg" and agg.engine_args.kv_transfer_config is None
    explicit = parse_worker_args(["--is-decode-worker", "--kv-transfer-config",
                                  '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'])
    assert explicit.engine_args.kv_transfer_config.kv_role == "kv_consumer"  # the user's config, untouched


def test_kvbm_connector_and_its_tiers(tmp_path):
    cfg = parse_worker_args(["--connector", "kvbm", "--kv-host-cache-gb", "0.5", "--kv-disk-cache-gb", "2",
                             "--kv-disk-cache-dir", str(tmp_path)]).engine_args.kv_transfer_config
    assert (cfg.kv_connector, cfg.kv_connector_module_path) == ("TurbineKvbmConnector", "turbine.vllm.kvbm_connector")
    assert cfg.kv_load_failure_policy == "recompute"  # a block that cannot be read back is computed instead
    assert cfg.kv_connector_extra_config == {"host_bytes": 2**29, "disk_bytes": 2 * 2**30, "disk_dir": str(tmp_path)}
    host_only = parse_worker_args(["--connector", "kvbm", "--kv-host-cache-gb", "1"]).engine_args.kv_transfer_config
    assert host_only.kv_connector_extra_config == {"host_bytes": 2**30}
    filtered = parse_worker_args(["--connector", "kvbm", "--kv-disk-cache-gb", "2", "--kv-disk-cache-dir", str(tmp_path),
                                  "--kv-disk-min-uses", "2"]).engine_args.kv_transfer_config
    assert filtered.kv_connector_extra_config["disk_min_uses"] == 2
    shared = parse_worker_args(["--connector", "kvbm", "--kv-shared-cache-gb", "4", "--kv-shared-cache-dir",
                                str(tmp_path / "s")]).engine_args.kv_transfer_config
    assert shared.kv_connector_extra_config == {"shared_bytes": 4 * 2**30, "shared_dir": str(tmp_path / "s")}


NIXL_DECODE = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
               "kv_connector_module_path": "turbine.vllm.nixl_cpu"}


@pytest.mark.parametrize("given", [["kvbm", "nixl"], ["nixl", "kvbm"], ["kvbm,nixl"]])
def test_a_prefill_worker_combines_kvbm_with_nixl_in_either_order(given, tmp_path):
    from vllm.config import KVTransferConfig

    from turbine.vllm.connectors import uses_nixl
    from turbine.vllm.kvbm_connector import kv_shared_tier

    cfg = parse_worker_args(["--is-prefill-worker", "--connector", *given, "--kv-host-cache-gb", "0.5",
                             "--kv-shared-cache-gb", "1", "--kv-shared-cache-dir", str(tmp_path)])
    kv = cfg.engine_args.kv_transfer_config
    assert kv.kv_connector == "MultiConnector" and uses_nixl(kv)
    order = [n for g in given for n in g.split(",")]
    parts = kv.kv_connector_extra_config["connectors"]
    assert [c["kv_connector"] for c in parts] == [
        {"kvbm": "TurbineKvbmPdConnector", "nixl": "NixlConnector"}[n] for n in order]
    kvbm = next(c for c in parts if c["kv_connector"] == "TurbineKvbmPdConnector")
    assert kvbm["kv_connector_extra_config"] == {"host_bytes": 2**29, "shared_bytes": 2**30, "shared_dir": str(tmp_path)}
    # vLLM reads the load-failure policy from the top-level config: a tier's unreadable block is recomputed.
    assert kv.kv_load_failure_policy == "recompute"

    class Vllm:  # what kv_shared_tier reads of a VllmConfig
        kv_transfer_config = kv
    assert kv_shared_tier(Vllm()) is not None  # the prefill worker's card announces its shared tier
    # Its kvbm half keeps vLLM's hybrid KV cache manager on, as a decode worker's NIXL has it: NIXL's
    # handshake refuses a peer whose setting differs. Alone (aggregated) it stays off.
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    assert KVConnectorFactory.supports_hma_config(kv)
    assert KVConnectorFactory.supports_hma_config(KVTransferConfig(**NIXL_DECODE))
    alone = parse_worker_args(["--connector", "kvbm", "--kv-host-cache-gb", "1"]).engine_args.kv_transfer_config
    assert not KVConnectorFactory.supports_hma_config(alone)


def test_kvbm_stats_rebuild_by_name_inside_multi_connector():
    """vLLM's periodic log line rebuilds a MultiConnector's stats from their class names (its registry)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    import turbine.vllm.worker  # noqa: F401  (the worker process: where the stats are rebuilt)
    from turbine.vllm.kvbm_stats import KvbmStats

    stats = MultiConnector.build_kv_connector_stats({"TurbineKvbmPdConnector": {"counters": {"hits": {"host": 2.0}}}})
    assert isinstance(stats["TurbineKvbmPdConnector"], KvbmStats)
    assert stats.reduce() == {"TurbineKvbmPdConnector": {"hits[host]": 2.0}}


def test_several_connectors_become_vllms_multi_connector():
    from turbine.vllm.connectors import ConnectorError, kv_transfer_config, uses_nixl

    cfg = kv_transfer_config(["nixl"], buffer_device="cuda", decode=False)
    # LMCache: refused on the CPU build whatever is installed; on a GPU it needs its package.
    for device, why in (("cpu", "No supported cpu connector"), ("cuda", "not installed")):
        with pytest.raises(ConnectorError, match=why):
            kv_transfer_config(["lmcache"], buffer_device=device, decode=False)
    assert cfg == {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cuda"}
    multi = kv_transfer_config(["nixl", "nixl"], buffer_device="cpu", decode=True)
    assert multi["kv_connector"] == "MultiConnector"
    assert [c["kv_connector"] for c in multi["kv_connector_extra_config"]["connectors"]] == ["NixlConnector"] * 2
    from vllm.config import KVTransferConfig
    assert uses_nixl(KVTransferConfig(**multi))


def test_nixl_side_channel_ports_are_unique_per_worker_on_a_host(monkeypatch):
    from turbine.vllm import connectors

    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_PORT", raising=False)
    from turbine.runtime.ports import CLAIM_RANGE

    first = connectors.claim_nixl_side_channel("127.0.0.1", 2)
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_PORT")
    second = connectors.claim_nixl_side_channel("127.0.0.1", 2)
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_PORT")
    assert {first, first + 1}.isdisjoint({second, second + 1})
    assert CLAIM_RANGE[0] <= first < CLAIM_RANGE[1]


def test_cpu_without_native_bfloat16_computes_in_float32():
    from turbine.vllm.args import cpu_dtype_default

    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
    assert cpu_dtype_default(avx2) == "float32"
    assert cpu_dtype_default(avx2.replace("avx2", "avx2 avx512f avx512_bf16")) is None
    assert cpu_dtype_default(avx2.replace("avx2", "avx2 amx_bf16 amx_tile")) is None
    assert cpu_dtype_default("no flags line here") is None
    # An explicit --dtype always wins; "auto" takes this machine's default.
    assert parse_worker_args(["--dtype", "bfloat16"]).engine_args.dtype == "bfloat16"
    with open("/proc/cpuinfo") as f:
        want = cpu_dtype_default(f.read()) or "auto"
    assert parse_worker_args([]).engine_args.dtype == want


def test_a_user_kv_events_config_is_refused_not_silently_dropped(capsys):
    # vLLM's own KV events config would replace Turbine's relay and leave KV routers blind.
    with pytest.raises(SystemExit) as info:
        parse_worker_args(["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq"}'])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-events-config is not supported" in err and "relays the engine's KV events" in err


def test_worker_configs_built_in_code_check_themselves():
    from turbine.config import ConfigError, DiscoveryConfig
    from turbine.worker.config import ServingConfig

    ok = dict(served_model_name="m", model_path="/m", discovery=DiscoveryConfig())
    assert ServingConfig(**ok).disaggregation_mode == "agg"
    for bad, flag in (({"disaggregation_mode": "both"}, "--disaggregation-mode"),
                      ({"event_plane": "kafka"}, "--event-plane"), ({"port": 70000}, "--port"),
                      ({"endpoint_types": ("chat", "embeddings")}, "--endpoint-types"),
                      ({"component": "a/b"}, "--component"), ({"kv_transfer_timeout": 0}, "--kv-transfer-timeout")):
        with pytest.raises(ConfigError, match=flag):
            ServingConfig(**ok, **bad)


def test_a_pooling_worker_serves_embeddings_only(capsys):
    cfg = parse_worker_args(["--runner", "pooling", "--convert", "embed"])
    assert cfg.endpoint_types == ("embeddings",)
    assert parse_worker_args([]).endpoint_types == ("chat", "completions")
    for argv, words in ((["--endpoint-types", "embeddings"], "serves embeddings only"),
                        (["--runner", "pooling", "--is-prefill-worker", "--connector", "nixl"], "not disaggregated")):
        with pytest.raises(SystemExit):
            parse_worker_args(argv)
        assert words in capsys.readouterr().err


def test_json_whitespace_is_compact_by_default_and_any_keeps_vllms_config(capsys):
    """Forced tool calls and JSON outputs: no free whitespace by default (benchmarks/frontend/json_whitespace.py)."""
    compact = parse_worker_args(["--enforce-eager"]).engine_args.structured_outputs_config
    assert (compact.backend, compact.disable_any_whitespace) == ("xgrammar", True)
    guidance = parse_worker_args(["--enforce-eager", "--structured-outputs-config", '{"backend": "guidance"}'])
    assert guidance.engine_args.structured_outputs_config.disable_any_whitespace is True
    loose = parse_worker_args(["--enforce-eager", "--json-whitespace", "any"]).engine_args.structured_outputs_config
    assert (loose.backend, loose.disable_any_whitespace) == ("auto", False)
    with pytest.raises(SystemExit):
        parse_worker_args(["--enforce-eager", "--structured-outputs-config", '{"backend": "outlines"}'])
    assert "--json-whitespace" in capsys.readouterr().err


@pytest.mark.parametrize("load_format", ["gms", "mx-source", "mx-target"])
def test_load_formats_turbine_has_not_built_are_refused_by_name(load_format, capsys):
    """Issue 33, §4: Dynamo maps these to other NVIDIA packages' worker classes; vLLM has no loader of these
    names, so the flag would fail deep inside vLLM's loader. Refused at parse time, on every build."""
    from turbine.vllm.args import parse_worker_args

    with pytest.raises(SystemExit) as info:
        parse_worker_args(["--load-format", load_format])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"--load-format {load_format}" in err and "is not built in Turbine" in err


def test_the_kv_tiers_run_vllms_v1_model_runner(monkeypatch, capsys):
    """Model Runner V2 does not rewind a request whose tier block failed to load (turbine.vllm.connectors): a
    kvbm worker keeps V1 unless told otherwise, and being told V2 is refused by name."""
    import os

    from turbine.vllm.connectors import V2_RUNNER_ENV, keep_model_runner_v1, uses_kvbm

    monkeypatch.delenv(V2_RUNNER_ENV, raising=False)
    cfg = parse_worker_args(["--connector", "kvbm", "--kv-host-cache-gb", "1"])
    assert uses_kvbm(cfg.engine_args.kv_transfer_config)
    assert not uses_kvbm(parse_worker_args([]).engine_args.kv_transfer_config)
    keep_model_runner_v1()  # what the worker does before it builds the engine
    assert os.environ[V2_RUNNER_ENV] == "0"
    monkeypatch.setenv(V2_RUNNER_ENV, "1")
    with pytest.raises(SystemExit):
        parse_worker_args(["--connector", "kvbm", "--kv-host-cache-gb", "1"])
    assert f"--connector kvbm with {V2_RUNNER_ENV}=1" in capsys.readouterr().err
    parse_worker_args([])  # without the tiers, V2 is the user's choice
