"""SamplingParams.bad_words (vLLM's): a word's tokens never follow each other in the output;
a one-token word is never sampled; the rest of the output is greedy decoding's."""

from __future__ import annotations

import pytest

from flashpage import LLM, SamplingParams

KW = dict(device="cpu", dtype="float32", num_gpu_blocks=64, attention_backend="torch_native")


@pytest.fixture(scope="module")
def llm(byte_model_dir):
    return LLM(str(byte_model_dir), **KW)


def _greedy(llm, prompt, **kw):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kw)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def _contains(ids: list[int], seq: list[int]) -> bool:
    return any(ids[i:i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))


def test_a_bad_word_is_cut_where_greedy_writes_it(llm):
    tok = llm.get_tokenizer()
    prompt = "Ada is 36 and lives in"
    g = _greedy(llm, prompt).token_ids
    # a two-token stretch of greedy's output that its own text tokenizes back to
    i = next(i for i in range(1, len(g) - 1)
             if tok.encode(tok.decode(g[i:i + 2]), add_special_tokens=False) == g[i:i + 2]
             and tok.decode(g[i:i + 2]).strip() == tok.decode(g[i:i + 2]))
    word = tok.decode(g[i:i + 2])
    out = _greedy(llm, prompt, bad_words=[word]).token_ids
    first = next(j for j in range(len(g)) if _contains(g[:j + 1], g[i:i + 2]))
    assert out[:first] == g[:first] and out[first] != g[first]
    for variant in (word, " " + word):
        ids = tok.encode(variant, add_special_tokens=False)
        assert not _contains(out, ids)
    # a one-token word: never sampled
    t = g[0]
    one = tok.decode([t])
    assert tok.encode(one, add_special_tokens=False) == [t]
    assert t not in _greedy(llm, prompt, bad_words=[one]).token_ids


def test_bad_words_are_checked(llm):
    for bad in (["ok", ""], "word", [3]):
        with pytest.raises(ValueError, match="bad_words must be a list of non-empty strings"):
            SamplingParams(bad_words=bad)
    outs = llm.generate(["hello", "world"], [SamplingParams(max_tokens=4, bad_words=["a"]),
                                             SamplingParams(max_tokens=4)], use_tqdm=False)
    assert all(o.error is None for o in outs)
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks
