"""Qwen2-Audio's audio input through the engine (models/qwen2_audio.py,
models/audio_features.py, engine/audio_io.py on engine/multimodal.py): our log-mel features
and token counts equal transformers' WhisperFeatureExtractor / Qwen2AudioProcessor's; greedy
tokens and prompt ids equal transformers' Qwen2AudioForConditionalGeneration.generate on its
processor's input for one audio, two in one prompt and a text-only prompt in one batch (an
audio at 8 kHz resampled); chunked prefill cutting an audio's rows; a repeated audio hits the
prefix cache without the encoder; bad requests are refused by name in a batch that still
runs, leaking no KV block; LLM.chat with input_audio and audio_url parts; the config's
errors. fp32, CPU; one bf16 CUDA test."""

from __future__ import annotations

import base64
import json
import shutil

import numpy as np
import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.config import ConfigError, ModelConfig
from flashpage.engine.audio_io import decode_audio, resample
from flashpage.inspect import inspect_config
from flashpage.models.audio_features import log_mel
from flashpage.models.qwen2_audio_config import AudioFeatures, audio_token_count, feature_frames
from tests.conftest import cpu_llm as _llm
from tests.conftest import ok_tokens as _tokens
from tests.qwen2_audio_checkpoint import (
    RATE,
    build_tiny_qwen2_audio,
    hf_greedy,
    hf_inputs,
    hf_processor,
    hf_qwen2_audio,
    tone,
    wav_bytes,
)

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
SLOT = "<|audio_bos|><|AUDIO|><|audio_eos|>"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = build_tiny_qwen2_audio(tmp_path_factory.mktemp("qwen2_audio"))
    return path, hf_qwen2_audio(path), hf_processor(path), _llm(path)


def _text(n: int, words: str = "What is that sound?") -> str:
    return "".join(f"Audio {k + 1}: {SLOT}\n" for k in range(n)) + words


def _want(hf, proc, text: str, audios: list[np.ndarray]) -> tuple[list[int], list[int]]:
    """(transformers' prompt ids, its greedy tokens) for 16 kHz ``audios``."""
    inputs = hf_inputs(proc, text, audios)
    return inputs["input_ids"][0].tolist(), hf_greedy(hf, inputs, MAX_NEW)


def test_features_and_counts_equal_transformers(ckpt):
    """Log-mel features of random audio (a token's least, odd lengths, exactly 30 s) equal
    WhisperFeatureExtractor's to float32 rounding; the frames its attention mask marks and
    the <|AUDIO|> tokens the processor writes are ours."""
    _, _, proc, _ = ckpt
    fe = proc.feature_extractor
    rng = np.random.default_rng(0)
    feats = AudioFeatures()
    for n in (321, 16_037, 47_999, 480_000):
        x = (0.3 * rng.standard_normal(n)).astype(np.float32)
        ref = fe(x, sampling_rate=RATE, return_attention_mask=True, padding="max_length", return_tensors="np")
        ours = log_mel([torch.from_numpy(x)], feats)[0].numpy()
        assert np.abs(ours - ref["input_features"][0]).max() < 1e-5, n
        assert feature_frames(n, feats) == int(ref["attention_mask"].sum())
        ids = proc(text=["<|AUDIO|>"], audio=[x], sampling_rate=RATE)["input_ids"][0]
        assert audio_token_count(n, feats) == list(ids).count(ckpt[1].config.audio_token_id), n
    assert audio_token_count(RATE, feats) == 25 and audio_token_count(480_000, feats) == 750
    assert audio_token_count(320, feats) == 0  # refused as too short (test_bad_requests)


def test_rows_equal_transformers_at_the_lengths_edges(ckpt):
    """Our encoder's rows (over each audio's own positions) equal transformers' projector
    output (over all 1,500, the padding masked) where the rows it keeps end: a token's least,
    an odd frame count, the frame before the chunk's last and the whole 30 s; audios of
    different lengths in one encode call."""
    _, hf, proc, llm = ckpt
    enc = llm.engine.mm_encoder
    seen: list[torch.Tensor] = []
    hook = hf.model.multi_modal_projector.register_forward_hook(lambda m, i, o: seen.append(o))
    rng = np.random.default_rng(3)
    waves = [(0.2 * rng.standard_normal(n)).astype(np.float32) for n in (321, 16_037, 479_841, 480_000)]
    try:
        want = []
        for x in waves:
            inputs = hf_inputs(proc, "hi <|AUDIO|>", [x])  # (one id alone would be a decode step)
            with torch.no_grad():
                hf(**inputs)
            want.append(seen.pop()[0, :enc.num_rows(torch.from_numpy(x))])
    finally:
        hook.remove()
    got = enc.encode([torch.from_numpy(x) for x in waves])
    assert [g.shape[0] for g in got] == [1, 25, 750, 750]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_audio_prompts_equal_transformers_whole_and_chunked(ckpt):
    """One audio, two of different lengths in one prompt (one given at 8 kHz: resampled) and
    a text-only prompt, in one batch: prompt ids the processor's, tokens transformers'; the
    same batch in steps of 16 tokens (each audio's rows cut across steps), each audio through
    the encoder once; another audio gives other tokens."""
    path, hf, proc, llm = ckpt
    a, b, c = tone(1.3, 1), tone(0.7, 2), tone(2.05, 3, rate=8000)
    c16 = resample(torch.from_numpy(c), 8000, RATE).numpy()
    cases = [(_text(1), [a]), (_text(2, "Which is longer?"), [b, c16]), ("the quick brown fox", [])]
    prompts = [{"prompt": cases[0][0], "multi_modal_data": {"audio": (a, RATE)}},
               {"prompt": cases[1][0], "multi_modal_data": {"audio": [b, (c, 8000)]}},
               {"prompt": cases[2][0]}]
    want = [_want(hf, proc, *c) for c in cases]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [w[0] for w in want]
    assert _tokens(outs) == [w[1] for w in want]
    tok = llm.engine.mm_encoder.config.audio_token_id
    assert [o.prompt_token_ids.count(tok) for o in outs] == [32, 17 + 51, 0]
    assert llm.engine.kv_manager.stats().blocks_used == 0
    other = llm.generate({"prompt": cases[0][0], "multi_modal_data": {"audio": tone(1.3, 9)}}, GREEDY,
                         use_tqdm=False)
    assert _tokens(other) != [want[0][1]]  # the audio's rows steer the tokens
    # ids with each audio's run written out already (the processor's) are kept as they are
    again = llm.generate({"prompt_token_ids": want[1][0], "multi_modal_data": prompts[1]["multi_modal_data"]},
                         GREEDY, use_tqdm=False)[0]
    assert again.prompt_token_ids == want[1][0] and _tokens([again]) == [want[1][1]]
    chunked = _llm(path, max_num_batched_tokens=16)
    enc = chunked.engine.mm_encoder
    encoded: list[int] = []
    encode = enc.encode
    enc.encode = lambda data: encoded.append(len(data)) or encode(data)
    assert _tokens(chunked.generate(prompts, GREEDY, use_tqdm=False)) == [w[1] for w in want]
    assert sum(encoded) == 3
    assert chunked.engine.kv_manager.stats().blocks_used == 0


def test_prefix_cache_hit_on_a_repeated_audio(ckpt):
    """The same audio again (another array of the same samples; the 8 kHz one resampled the
    same way) hits the first's blocks and the encoder does not run; another audio shares the
    text before it alone."""
    _, hf, proc, llm = ckpt
    kv = llm.engine.kv_manager
    text = "the quick brown fox jumps over the lazy dog " + _text(1)
    enc = llm.engine.mm_encoder
    encoded: list[int] = []
    encode = enc.encode
    enc.encode = lambda data: encoded.append(len(data)) or encode(data)
    x8 = tone(1.1, 5, rate=8000)

    def run(audio):
        return llm.generate({"prompt": text, "multi_modal_data": {"audio": audio}}, GREEDY, use_tqdm=False)[0]

    first = run((x8, 8000))
    x16 = resample(torch.from_numpy(x8), 8000, RATE).numpy()
    assert _tokens([first]) == [_want(hf, proc, text, [x16])[1]]
    n_prompt = len(first.prompt_token_ids)
    hits = kv.prefix_hits
    assert _tokens([run((x8.copy(), 8000))]) == _tokens([first])
    assert _tokens([run(x16)]) == _tokens([first])  # the same samples at 16 kHz: the same digest
    assert kv.prefix_hits - hits == 2 * ((n_prompt - 1) // 8 * 8)
    assert len(encoded) == 1
    hits = kv.prefix_hits
    run(tone(1.1, 6))
    start = first.prompt_token_ids.index(enc.config.audio_token_id)
    assert kv.prefix_hits - hits == start // 8 * 8
    assert kv.stats().blocks_used == 0
    del enc.encode


def test_transformers_517_layout_gives_the_same_tokens(ckpt, tmp_path):
    """The same weights as transformers 5.17's save_pretrained writes a Qwen2-Audio (the GPU
    image's: the text model's tensors under ``language_model.model.model.``, one ``model.`` more
    than the published files): the same tokens as the published layout's."""
    from tests.conftest import edited_copy

    path, hf, proc, _ = ckpt
    def rename(tensors):
        for n in [n for n in tensors if n.startswith("language_model.model.")]:
            tensors["language_model.model.model." + n.removeprefix("language_model.model.")] = tensors.pop(n)

    v517 = edited_copy(path, tmp_path / "v517", edit=rename)
    audio = tone(0.9, 7)
    got = _llm(v517).generate({"prompt": _text(1), "multi_modal_data": {"audio": audio}}, GREEDY, use_tqdm=False)
    assert _tokens(got) == [_want(hf, proc, _text(1), [audio])[1]]


def test_bad_requests_are_refused_by_name_and_leak_nothing(ckpt, tiny_checkpoint):
    """Each bad audio request in a batch beside a good one is refused naming what is wrong;
    the good one runs as transformers'; no KV block is left. limit_mm_per_prompt {"audio": 0}
    serves the text model alone; audio given to a text model is refused too."""
    path, hf, proc, _ = ckpt
    llm = _llm(path, max_model_len=200, limit_mm_per_prompt={"audio": 2})
    kv = llm.engine.kv_manager
    free = kv.num_free_blocks
    tok = llm.engine.mm_encoder.config.audio_token_id
    a = tone(0.5, 7)
    one = _text(1)
    ids = llm.get_tokenizer().encode(one)
    bad = [
        ((a, "16000"), "audio 0: its sampling rate must be a number of Hz"),
        ((a, 7), "sampling rate 7 Hz is not taken"),
        ((a, 16000, 1), "a tuple must be (waveform, sampling_rate)"),
        (np.zeros(0, np.float32), "audio 0 is empty (0 samples)"),
        (np.zeros(320, np.float32), "audio 0 is too short: 320 samples at 16000 Hz give no audio token"),
        ((tone(30.5, 1, rate=8000), 8000), "audio 0 is 30.50 s long (488000 samples at 16000 Hz)"),
        (np.stack([a, a]), "audio 0 has shape [2, 8000]: give one channel"),
        ((a * 32767).astype(np.int16), "integer samples (int16) given"),
        (np.full(800, np.nan, np.float32), "audio 0: its samples hold inf or NaN"),
        ("clip.wav", "audio 0 is a str"),
        ([a, a], f"1 audio token(s) (<|AUDIO|>, id {tok}) but 2 audio(s) were given"),
        ([a, a, a], "3 audio item(s) in one prompt, but limit_mm_per_prompt allows 2"),
    ]
    runs = [t for t in ids if t != tok]
    runs[2:2] = [tok] * 3  # a run of 3 for an audio of 12 tokens: neither one token nor its count
    prompts = [{"prompt": one, "multi_modal_data": {"audio": a}}]
    prompts += [{"prompt": one, "multi_modal_data": {"audio": x}} for x, _ in bad]
    prompts += [{"prompt": one}, {"prompt_token_ids": ids, "multi_modal_data": {"image": a}},
                {"prompt_token_ids": runs, "multi_modal_data": {"audio": a}},
                {"prompt": one, "multi_modal_data": {"audio": tone(7.5, 2)}}]
    needles = [n for _, n in bad] + [f"the prompt has audio tokens (<|AUDIO|>, id {tok}) but no audio was given",
                                     "multi_modal_data ['image']: this model takes \"audio\" only",
                                     f"the prompt has 3 audio token(s) (<|AUDIO|>, id {tok}) but 1 audio(s)",
                                     "max_model_len is 200"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for out, needle in zip(outs[1:], needles, strict=True):
        assert out.error is not None and not out.outputs, needle
        assert needle in out.error, (needle, out.error)
    assert _tokens(outs[:1]) == [_want(hf, proc, one, [a])[1]]
    assert kv.num_free_blocks == free and kv.stats().blocks_used == 0
    assert not llm.engine.has_unfinished_requests()
    alone = _llm(path, limit_mm_per_prompt={"audio": 0})  # the text model alone, the encoder not loaded
    assert alone.engine.mm_encoder is None
    out = alone.generate({"prompt": "hello", "multi_modal_data": {"audio": a}}, GREEDY, use_tqdm=False)[0]
    assert "limit_mm_per_prompt allows 0" in out.error
    text_only = _llm(tiny_checkpoint("llama2_mha"))
    out = text_only.generate({"prompt_token_ids": [5, 6, 7], "multi_modal_data": {"audio": a}}, GREEDY,
                             use_tqdm=False)[0]
    assert "takes no audio input: LlamaForCausalLM is a text-only model" in out.error


def test_chat_with_input_audio_and_audio_url(ckpt, tmp_path):
    """LLM.chat with an input_audio part (a 16-bit WAV) and an audio_url part (a data URL of
    a 24-bit stereo WAV at 22.05 kHz): the template's "Audio k: ..." slots, prompt ids the
    processor's for that text and the decoded (resampled) audio, tokens transformers'; a
    file:// URL outside allowed_local_media_path is refused by name."""
    _, hf, proc, llm = ckpt
    a, b = tone(0.9, 11), tone(0.6, 12, rate=22_050)
    wav_a, wav_b = wav_bytes(a), wav_bytes(b, 22_050, width=3, channels=2)
    conv = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_a).decode(), "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + base64.b64encode(wav_b).decode()}},
        {"type": "text", "text": "Which is longer?"}]}]
    out = llm.chat(conv, GREEDY, use_tqdm=False)[0]
    text = proc.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "audio", "audio_url": "a"}, {"type": "audio", "audio_url": "b"},
                                      {"type": "text", "text": "Which is longer?"}]}],
        add_generation_prompt=True, tokenize=False)
    assert text.count(SLOT) == 2 and "Audio 2: " in text
    xa, ra = decode_audio(wav_a)
    xb, rb = decode_audio(wav_b)
    assert ra == RATE and rb == 22_050 and np.abs(xb - b).max() < 1e-6
    xb16 = resample(torch.from_numpy(xb), rb, RATE).numpy()
    ids, want = _want(hf, proc, text, [xa, xb16])
    assert out.prompt_token_ids == ids and _tokens([out]) == [want]
    with pytest.raises(ValueError, match="file:// URLs are read only under allowed_local_media_path"):
        llm.chat([{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": f"file://{tmp_path}/a.wav"}}]}],
                 GREEDY, use_tqdm=False)


def test_chat_placeholders_in_both_content_formats(ckpt):
    """A template that loops over content parts gets {"type": "audio", "audio": ""} parts
    (Qwen2-Audio's tests 'audio' in content); one that prints a string gets vLLM's "Audio k:
    <|audio_bos|><|AUDIO|><|audio_eos|>" lines, numbered across the conversation, before
    each message's text."""
    from flashpage.engine.multimodal import place_images

    enc = ckpt[3].engine.mm_encoder
    conv = [{"role": "user", "content": "hi"}, {"role": "user", "content": "and this"}]
    parts = [[("audio", None), ("audio", None), ("text", "hi")], [("audio", None), ("text", "and this")]]
    printed = place_images(conv, parts, "{{ message['content'] }}", "", audio_placeholder=enc.placeholder_text)
    assert [m["content"] for m in printed] == [
        f"Audio 1: {SLOT}\nAudio 2: {SLOT}\nhi", f"Audio 3: {SLOT}\nand this"]
    looped = place_images(conv, parts, ckpt[2].tokenizer.chat_template, "", audio_placeholder=enc.placeholder_text)
    assert looped[1]["content"] == [{"type": "audio", "audio": ""}, {"type": "text", "text": "and this"}]
    text = ckpt[2].tokenizer.apply_chat_template(looped, tokenize=False)
    assert text.count(SLOT) == 3 and f"Audio 3: {SLOT}\nand this" in text


def test_config_and_inspect(ckpt, tmp_path):
    """A feature extractor whose mel bins or chunk are not the encoder's, dither, and an
    encoder of another kind are ConfigErrors naming the field; flashpage inspect counts the
    engine's encoder and a 30 s audio's 750 tokens."""
    path = ckpt[0]
    d = json.loads((path / "config.json").read_text())
    for edit, needle in (({"feature_size": 80}, "feature_size 80 differs from the encoder's audio_config.num_mel_bins 128"),
                         ({"chunk_length": 20}, "takes 2 x max_source_positions = 3000"),
                         ({"dither": 1e-4}, "dither 0.0001")):
        dst = tmp_path / str(len(list(tmp_path.iterdir())))
        shutil.copytree(path, dst)
        pc = json.loads((dst / "preprocessor_config.json").read_text())
        (dst / "preprocessor_config.json").write_text(json.dumps({**pc, **edit}))
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            ModelConfig.from_hf(str(dst))
    with pytest.raises(ConfigError, match="audio_config.model_type 'whisper'"):
        ModelConfig.from_hf({**d, "audio_config": {**d["audio_config"], "model_type": "whisper"}})
    info = inspect_config(ModelConfig.from_hf(str(path)), 1 << 30, "fp32")
    enc = ckpt[3].engine.mm_encoder
    assert info["audio_input"] and not info["image_input"] and info["vision"] is None
    assert info["audio"]["params"] == sum(p.numel() for p in enc.parameters())
    assert info["audio"]["max_audio_tokens"] == 750 == enc.num_rows(torch.zeros(480_000))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_qwen2_audio_on_the_gpu_bf16(tmp_path):
    """bf16 on CUDA (triton backend, graphs captured): audio steps run eagerly beside graphed
    decodes; tokens equal an eager engine's. Against transformers on the GPU, teacher-forced
    on our tokens: our token is fp32's top one about as often as transformers' own bf16 top
    token is (conftest.assert_top_one_agreement)."""
    from tests.conftest import assert_top_one_agreement

    path = build_tiny_qwen2_audio(tmp_path / "qa_64", text=dict(hidden_size=128, num_attention_heads=2,
                                                                num_key_value_heads=1))  # head_dim 64
    hf = hf_qwen2_audio(path, device="cuda")
    hf16 = hf_qwen2_audio(path, dtype=torch.bfloat16, device="cuda")
    proc = hf_processor(path)
    cases = [(_text(i % 3, "What is that sound?"), [tone(0.4 + 0.3 * k + 0.1 * i, 40 + 3 * i + k) for k in range(i % 3)])
             for i in range(32)]  # 256 tokens: agreement rates worth comparing
    prompts = [{"prompt": t, **({"multi_modal_data": {"audio": [(x, RATE) for x in xs]}} if xs else {})}
               for t, xs in cases]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(**kw):
        llm = LLM(str(path), dtype="bfloat16", device="cuda", attention_backend="triton", block_size=16,
                  max_num_batched_tokens=64, **kw)
        return llm.generate(prompts, params, use_tqdm=False), llm

    graphed, llm = run()
    assert llm.engine.runner.graphs is not None, "decode graphs were not captured"
    eager, _ = run(enforce_eager=True)
    assert _tokens(graphed) == _tokens(eager)
    for o, (t, xs) in zip(graphed, cases, strict=True):
        assert o.prompt_token_ids == hf_inputs(proc, t, xs)["input_ids"][0].tolist()

    def mm_inputs(i, x):
        xs = cases[i][1]
        if not xs:
            return {}
        inputs = hf_inputs(proc, cases[i][0], xs)
        return {"input_features": inputs["input_features"], "feature_attention_mask": inputs["feature_attention_mask"]}

    assert_top_one_agreement("qwen2_audio", hf, hf16, graphed, mm_inputs)
    assert llm.engine.kv_manager.stats().blocks_used == 0
