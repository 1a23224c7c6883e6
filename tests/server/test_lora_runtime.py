"""Runtime LoRA updating (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, with
FLASHPAGE_ALLOW_RUNTIME_LORA_UPDATING=1): an adapter loaded while the server runs answers
as its merged checkpoint does, unloading stops new requests naming it, a name loaded again
from another folder is the new adapter; without the setting the paths do not exist."""

from __future__ import annotations

import httpx
import pytest

from flashpage import LLM, SamplingParams
from tests.peft_adapter import merge_adapter, write_adapter
from tests.server.conftest import engine_kwargs, live_server
from tests.server.test_errors import assert_error, post

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def runtime_adapters(tiny_model_dir, tmp_path_factory):
    """Two adapters and the greedy text of PROMPT on the base and each merged checkpoint."""
    root = tmp_path_factory.mktemp("lora_runtime")
    a = write_adapter(root / "a", tiny_model_dir, r=8, alpha=16, seed=3)
    b = write_adapter(root / "b", tiny_model_dir, r=4, alpha=8, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    text = {}
    for name, path in (("base", tiny_model_dir), ("a", merge_adapter(tiny_model_dir, a, root / "ma")),
                       ("b", merge_adapter(tiny_model_dir, b, root / "mb"))):
        text[name] = LLM(str(path), **engine_kwargs()).generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text
    assert len(set(text.values())) == 3
    return {"a": str(a), "b": str(b)}, text


@pytest.fixture(scope="module")
def runtime_server(tiny_model_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHPAGE_ALLOW_RUNTIME_LORA_UPDATING", "1")
        with live_server(tiny_model_dir, engine_kw=dict(enable_lora=True, max_loras=1,
                                                        max_lora_rank=8)) as s:
            yield s


def _text(server, model: str) -> httpx.Response:
    return post(server, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 8,
                                            "temperature": 0, "ignore_eos": True})


def test_load_serve_unload_reload(runtime_server, runtime_adapters):
    paths, want = runtime_adapters
    s = runtime_server
    r = post(s, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": paths["a"]})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'x' added successfully."
    assert [m["id"] for m in httpx.get(s.url + "/v1/models", timeout=30).json()["data"]] == ["tiny", "x"]
    assert _text(s, "x").json()["choices"][0]["text"] == want["a"]
    assert _text(s, "tiny").json()["choices"][0]["text"] == want["base"]
    assert_error(post(s, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": paths["b"]}),
                 400, "The lora adapter 'x' has already been loaded.", param="lora_name")
    r = post(s, "/v1/unload_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'x' removed successfully."
    assert _text(s, "x").status_code == 404
    assert_error(post(s, "/v1/unload_lora_adapter", {"lora_name": "x"}), 404,
                 "The lora adapter 'x' cannot be found.", param="lora_name")
    # the name again, another folder: the new adapter, not the old copy
    assert post(s, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": paths["b"]}).status_code == 200
    assert _text(s, "x").json()["choices"][0]["text"] == want["b"]
    assert s.async_engine.engine.lora.stats()["loaded_on_host"] == [2]  # the unloaded one is gone
    assert s.wait_idle()["flashpage:kv_cache_blocks_used"] == 0


def test_bad_loads_are_400s(runtime_server, tmp_path):
    s = runtime_server
    assert_error(post(s, "/v1/load_lora_adapter", {"lora_name": "y", "lora_path": str(tmp_path / "no")}),
                 400, "could not load LoRA adapter 'y'", param="lora_path")
    assert_error(post(s, "/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": str(tmp_path)}),
                 400, "served model's name", param="lora_name")
    assert_error(post(s, "/v1/load_lora_adapter", {"lora_name": "y"}), 400, param="lora_path")
    assert "y" not in [m["id"] for m in httpx.get(s.url + "/v1/models", timeout=30).json()["data"]]


def test_paths_exist_only_when_allowed(tiny_model_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("FLASHPAGE_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
        mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0")
        with live_server(tiny_model_dir, engine_kw=dict(enable_lora=True, max_lora_rank=8)) as s:
            for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                assert post(s, path, {"lora_name": "x", "lora_path": "/x"}).status_code == 404


def test_without_enable_lora_loading_is_a_400(tiny_model_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        with live_server(tiny_model_dir) as s:
            assert_error(post(s, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"}),
                         400, "--enable-lora", param="lora_name")
