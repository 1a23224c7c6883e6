"""Choosing an attention backend: the default and why, a forced backend that cannot run
stops with its reasons, and the environment variable."""

from __future__ import annotations

import pytest
import torch

from flashpage import LLM
from flashpage.attention.registry import BackendUnavailable, backend_report, select_backend
from flashpage.config import ModelConfig

CPU = torch.device("cpu")


@pytest.fixture
def gqa_config(tiny_checkpoint) -> ModelConfig:
    return ModelConfig.from_hf(tiny_checkpoint("head64_gqa"))


def test_default_on_cpu_is_torch_native_even_with_the_interpreter(gqa_config, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("FLASHPAGE_ATTENTION_BACKEND", raising=False)
    cls, why = select_backend(None, gqa_config, CPU, torch.float32)
    assert cls.name == "torch_native" and "default on cpu" in why


def test_forced_triton_without_gpu_says_why(gqa_config, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailable, match=r"'triton' cannot run .*needs a CUDA GPU"):
        select_backend("triton", gqa_config, CPU, torch.float32)


def test_forced_backend_never_falls_back(tiny_checkpoint, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailable, match="needs a CUDA GPU"):
        LLM(str(tiny_checkpoint("head64_gqa")), device="cpu", attention_backend="triton")


def test_environment_variable_forces_a_backend(gqa_config, tiny_checkpoint, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("FLASHPAGE_ATTENTION_BACKEND", "triton")
    with pytest.raises(BackendUnavailable, match="needs a CUDA GPU"):
        select_backend(None, gqa_config, CPU, torch.float32)
    monkeypatch.setenv("FLASHPAGE_ATTENTION_BACKEND", "torch_native")
    llm = LLM(str(tiny_checkpoint("head64_gqa")), device="cpu")
    assert llm.engine.backend_name == "torch_native"


def test_unknown_backend_names_the_choices(gqa_config):
    with pytest.raises(BackendUnavailable, match="unknown attention backend 'fast'.*torch_native"):
        select_backend("fast", gqa_config, CPU, torch.float32)


def test_mla_and_head_dim_reports(gqa_config, tiny_checkpoint, tiny_mla_checkpoint, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the device is fine: only the model is not
    mla = ModelConfig.from_hf(tiny_mla_checkpoint("deepseek_v2"))
    report = {e["name"]: e for e in backend_report(mla, CPU, torch.float32)}
    assert report["torch_native"]["default"] and report["torch_native"]["can_run"]
    # MLA runs on triton (decode kernel); on the CPU only when asked for, never by default.
    assert report["triton"]["can_run"] and not report["triton"]["default"]
    small = ModelConfig.from_hf(tiny_checkpoint("qwen3_qknorm"))  # head_dim 16
    report = {e["name"]: e for e in backend_report(small, CPU, torch.float32)}
    assert report["triton"]["reasons"] == ["head_dim 16 is not a multiple of 8 from 32 to 256"]


def test_inspect_backends_flag(capsys, monkeypatch):
    from flashpage.inspect import main

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = str(__import__("tests.conftest", fromlist=["SHARED_CONFIGS"]).SHARED_CONFIGS / "llama-3-8b")
    if not __import__("os").path.isdir(cfg):
        pytest.skip("../shared/configs is not beside the checkout")
    assert main([cfg, "--backends", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "torch_native  default" in out and "triton        cannot run: needs a CUDA GPU" in out
