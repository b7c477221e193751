"""The mocker's command line: defaults from the model folder, and bad flags named."""

import pytest

from turbine.mocker.args import parse_mocker_args


def test_defaults_come_from_the_embedded_model(model_dir):
    cfg = parse_mocker_args([])
    assert cfg.served_model_name == "smollm2-135m-instruct"
    assert cfg.tokenizer_path == str(model_dir)
    assert cfg.max_model_len == 8192  # the model's max_position_embeddings
    assert (cfg.model_info.vocab_size, cfg.model_info.eos_token_ids) == (49152, (2,))
    assert (cfg.num_workers, cfg.num_gpu_blocks, cfg.block_size, cfg.enable_prefix_caching) == (1, 16384, 64, True)
    assert cfg.gc_interval == 60.0
    card = cfg.model_card("abc", engine="mocker", tokenizer_path=cfg.tokenizer_path, context_length=8192,
                          kv_block_size=64, total_kv_blocks=16384, max_num_seqs=256, max_num_batched_tokens=8192)
    assert (card.engine, card.endpoint, card.endpoint_types) == ("mocker", "generate", ["chat", "completions"])


@pytest.mark.parametrize("argv,flag", [
    (["--endpoint-types", "embeddings"], "--endpoint-types"),  # the mocker does not embed
    (["--num-workers", "0"], "--num-workers"),
    (["--block-size", "0"], "--block-size"),
    (["--speedup-ratio", "-1"], "--speedup-ratio"),
    (["--natural-output-len", "-1"], "--natural-output-len"),
    (["--num-gpu-blocks", "10", "--max-model-len", "4096"], "--num-gpu-blocks"),
    (["--profile", "/no/such/profile.json"], "--profile"),
    (["--num-workers", "2", "--port", "9000"], "--port"),
    (["--model", "/no/such/model/folder"], "--model"),
    (["--endpoint", "a.b"], "--endpoint"),
    (["--gc-interval", "-1"], "--gc-interval"),
    (["--startup-time", "-1"], "--startup-time"),
    (["--sleep-time", "-1"], "--sleep-time"),
    (["--wake-time", "-0.5"], "--wake-time"),
])
def test_bad_mocker_flags_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as info:
        parse_mocker_args(argv)
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


async def test_sleep_and_wake_take_the_times_given(monkeypatch):
    """--sleep-time / --wake-time: the simulated engine waits that long (real seconds) in a sleep and a
    wake, as a GPU engine's (the planner benchmark's sleeping pool); nothing timed: the waits are recorded."""
    import turbine.mocker.worker as worker
    from turbine.mocker.tokens import TokenSampler

    cfg = parse_mocker_args(["--sleep-time", "0.08", "--wake-time", "0.12"])
    assert (cfg.sleep_time, cfg.wake_time) == (0.08, 0.12)
    info = cfg.model_info
    engines = worker.WorkerEngines(cfg, TokenSampler(info.vocab_size, info.eos_token_ids, info.special_token_ids,
                                                     cfg.natural_output_len, info.word_token_ids))
    waits = []

    async def sleep(seconds):
        waits.append(seconds)

    monkeypatch.setattr(worker.asyncio, "sleep", sleep)
    await engines.sleep(1)
    await engines.wake_up()
    assert waits == [0.08, 0.12] and engines.level == 0
