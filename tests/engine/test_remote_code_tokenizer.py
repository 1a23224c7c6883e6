"""A checkpoint whose tokenizer is its own Python (tokenizer_config.json's auto_map, as
InternLM2's tokenization_internlm2.py): loaded only with trust_remote_code (vLLM's flag),
refused by name without it; the model's code stays ours either way."""

from __future__ import annotations

import json
import shutil

import pytest

from flashpage import LLM, SamplingParams
from flashpage.config import ConfigError

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
TOY = '''from transformers import PreTrainedTokenizerFast


class ToyTokenizer(PreTrainedTokenizerFast):
    """The checkpoint's own class: what transformers runs only when trusted."""

    toy_marker = "ran"
'''


@pytest.fixture(scope="module")
def remote(byte_model_dir, tmp_path_factory):
    """byte_model_dir with its tokenizer class moved into the folder's own module."""
    path = tmp_path_factory.mktemp("remote_tok") / "m"
    shutil.copytree(byte_model_dir, path)
    (path / "tokenization_toy.py").write_text(TOY)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": [None, "tokenization_toy.ToyTokenizer"]}
    cfg["tokenizer_class"] = "ToyTokenizer"
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def test_refused_by_name_without_the_flag(remote):
    with pytest.raises(ConfigError, match=r"tokenization_toy\.ToyTokenizer.*--trust-remote-code"):
        LLM(str(remote), device="cpu", dtype="float32")


def test_tokenizer_folder_refused_the_same_way(byte_model_dir, remote):
    """--tokenizer naming such a folder beside a plain model: the same refusal, the same
    load with the flag."""
    with pytest.raises(ConfigError, match=r"ToyTokenizer"):
        LLM(str(byte_model_dir), tokenizer=str(remote), device="cpu", dtype="float32")
    llm = LLM(str(byte_model_dir), tokenizer=str(remote), device="cpu", dtype="float32",
              trust_remote_code=True)
    assert type(llm.get_tokenizer()).toy_marker == "ran"


def test_with_the_flag_its_class_runs_and_text_prompts_work(byte_model_dir, remote):
    """With trust_remote_code the checkpoint's class is the tokenizer, and a text prompt's
    tokens are those of the same model with the plain tokenizer."""
    llm = LLM(str(remote), device="cpu", dtype="float32", trust_remote_code=True)
    tok = llm.get_tokenizer()
    assert type(tok).__name__ == "ToyTokenizer" and tok.toy_marker == "ran"
    plain = LLM(str(byte_model_dir), device="cpu", dtype="float32")
    prompts = ["hello remote code", "{\"a\": 1}"]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want and all(len(t) == 6 for t in got)
    assert llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0].outputs[0].text


def test_cli_passes_the_flag(monkeypatch):
    """`--trust-remote-code` (a pasted vLLM command's) reaches LLM; absent, False."""
    from flashpage import cli

    seen: list[bool] = []
    monkeypatch.setattr("flashpage.llm.LLM", lambda *a, **kw: seen.append(kw["trust_remote_code"]))
    parser = cli.build_parser()
    for argv, want in ((["serve", "m", "--trust-remote-code"], True), (["serve", "m"], False)):
        cli.build_llm(parser.parse_args(argv))
        assert seen[-1] is want
