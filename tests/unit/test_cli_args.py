"""Invalid or conflicting flags exit with a message that names the flag."""

import pytest

from turbine.vllm.args import parse_worker_args


@pytest.mark.parametrize("argv,flag", [
    (["--endpoint-types", "chat,embeddings"], "--endpoint-types"),
    (["--custom-jinja-template", "/no/such/file.jinja"], "--custom-jinja-template"),
    (["--system-port", "70000"], "--system-port"),
    (["--migration-limit", "-1"], "--migration-limit"),
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


def test_defaults_and_dyn_style_endpoint(tmp_path):
    cfg = parse_worker_args(["--endpoint", "dyn://ns1.comp1.gen1", "--enforce-eager"])
    assert (cfg.namespace, cfg.component, cfg.endpoint) == ("ns1", "comp1", "gen1")
    assert cfg.served_model_name == "smollm2-135m-instruct"
    assert cfg.engine_args.enable_prefix_caching is True  # on unless turned off
    off = parse_worker_args(["--no-enable-prefix-caching"])
    assert off.engine_args.enable_prefix_caching is False
    assert cfg.discovery.backend == "file"


def test_turbine_cli_serve_rejects_bad_port(capsys):
    from turbine.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--http-port", "0"])
    assert "--http-port" in capsys.readouterr().err
