"""A vLLM ``serve`` command pasted as it is: its compatibility flags (one GPU, always-chunked
prompts, our own model code) and its HTTP ones (CORS, TLS, root path, uvicorn's log level)."""

from __future__ import annotations

import httpx
import pytest

from flashpage.cli import apply_vllm_compat, build_parser
from tests.server.conftest import engine_kwargs, live_server

VLLM_COMMAND = ["serve", "m", "--tensor-parallel-size", "1", "--trust-remote-code",
                "--enable-prefix-caching", "--enable-chunked-prefill", "--disable-log-requests",
                "--disable-log-stats", "--swap-space", "4", "--max-logprobs", "20",
                "--allowed-origins", '["https://app.example"]', "--allow-credentials",
                "--ssl-keyfile", "key.pem", "--ssl-certfile", "cert.pem", "--root-path", "/llm",
                "--uvicorn-log-level", "info"]


def test_a_pasted_vllm_command_parses_and_means_what_it_says():
    args = build_parser().parse_args(VLLM_COMMAND)
    apply_vllm_compat(args)
    assert not args.no_prefix_caching and args.trust_remote_code
    assert args.allowed_origins == ["https://app.example"] and args.allow_credentials
    assert (args.ssl_keyfile, args.ssl_certfile, args.root_path, args.uvicorn_log_level) == (
        "key.pem", "cert.pem", "/llm", "info")
    args = build_parser().parse_args(["serve", "--no-enable-prefix-caching", "-tp", "1"])
    apply_vllm_compat(args)
    assert args.no_prefix_caching
    assert args.allowed_origins == ["*"] and not args.allow_credentials  # vLLM's CORS defaults


@pytest.mark.parametrize("flags,match", [
    (["--tensor-parallel-size", "2"], r"--tensor-parallel-size 2: flashpage runs on one GPU"),
    (["-pp", "4"], r"--pipeline-parallel-size 4: flashpage runs on one GPU"),
    (["--max-logprobs", "50"], r"--max-logprobs 50: at most 20"),
])
def test_what_one_gpu_cannot_do_is_named(flags, match):
    args = build_parser().parse_args(["serve", *flags])
    with pytest.raises(ValueError, match=match):
        apply_vllm_compat(args)


def test_bad_cors_lists_are_usage_errors(capsys):
    for bad in ("*", '{"a": 1}', "[1]"):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["serve", "--allowed-origins", bad])
        assert e.value.code == 2
    assert "--allowed-origins" in capsys.readouterr().err


def test_run_server_hands_tls_root_path_and_cors_on(tiny_model_dir, monkeypatch):
    import uvicorn

    from flashpage.server import api_server

    seen: dict = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    kw = engine_kwargs()
    args = build_parser().parse_args(
        ["serve", str(tiny_model_dir), "--dtype", kw["dtype"], "--device", "cpu",
         "--max-model-len", str(kw["max_model_len"]), "--block-size", str(kw["block_size"]),
         *VLLM_COMMAND[2:]])
    assert api_server.run_server(args) == 0
    assert (seen["ssl_keyfile"], seen["ssl_certfile"], seen["log_level"]) == ("key.pem", "cert.pem", "info")
    assert "ssl_ca_certs" not in seen  # not given: not passed
    assert seen["root_path"] == "/llm"
    app = seen["app"]
    cors = [m for m in app.user_middleware if m.cls.__name__ == "CORSMiddleware"]
    assert len(cors) == 1 and cors[0].kwargs["allow_origins"] == ["https://app.example"]


def test_cors_preflight_needs_no_key_and_answers_carry_the_origin(tiny_model_dir):
    cors = {"allow_origins": ["https://app.example"], "allow_methods": ["*"],
            "allow_headers": ["*"], "allow_credentials": False}
    with live_server(tiny_model_dir, api_key="k", cors=cors) as srv:
        pre = httpx.options(f"{srv.url}/v1/chat/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.get(f"{srv.url}/v1/models", headers={"Origin": "https://app.example",
                                                      "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.get(f"{srv.url}/v1/models", headers={"Origin": "https://evil.example",
                                                          "Authorization": "Bearer k"})
        assert "access-control-allow-origin" not in other.headers
        assert httpx.get(f"{srv.url}/v1/models", headers={"Origin": "https://app.example"}).status_code == 401
