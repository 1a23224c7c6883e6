"""Chat completions with audio parts on a tiny Qwen2-Audio (server/images.py,
engine/audio_io.py, models/qwen2_audio.py): an input_audio part (a WAV in base64) and an
audio_url part (a file:// URL under --allowed-local-media-path, a WAV at 8 kHz: resampled)
give LLM.generate's tokens for the prompt Qwen2-Audio's chat template renders (its "Audio k:
<|audio_bos|><|AUDIO|><|audio_eos|>" slots) and the decoded audio, usage counting each
audio's expanded tokens, and LLM.chat's; an audio too long, undecodable bytes and an image
part are 400s naming why, leaving no KV block behind."""

from __future__ import annotations

import base64

import pytest

from flashpage import LLM, SamplingParams
from flashpage.engine.audio_io import decode_audio
from tests.qwen2_audio_checkpoint import build_tiny_qwen2_audio, tone, wav_bytes
from tests.server.conftest import engine_kwargs, live_server
from tests.server.test_llava_server import MAX_TOKENS, chat


@pytest.fixture(scope="module")
def audio_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen2_audio_server")
    root = tmp / "media"
    root.mkdir()
    (root / "low.wav").write_bytes(wav_bytes(tone(0.8, 21, rate=8000), 8000))
    kw = {"allowed_local_media_path": str(root), "max_model_len": 256}
    return build_tiny_qwen2_audio(tmp / "model"), root, kw


def _input_audio(raw: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(raw).decode(), "format": "wav"}}


def test_audio_parts_equal_generate_and_llm_chat(audio_model):
    path, root, kw = audio_model
    inline = wav_bytes(tone(0.6, 20))
    parts = [_input_audio(inline), {"type": "audio_url", "audio_url": {"url": f"file://{root}/low.wav"}}]
    msg = [{"role": "user", "content": [*parts, {"type": "text", "text": "the quick brown fox"}]}]
    llm = LLM(str(path), **{**engine_kwargs(), **kw})
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "audio", "audio_url": "a"}, {"type": "audio", "audio_url": "b"},
        {"type": "text", "text": "the quick brown fox"}]}], add_generation_prompt=True, tokenize=False)
    data = {"audio": [decode_audio(inline), decode_audio((root / "low.wav").read_bytes())]}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    want = llm.generate({"prompt_token_ids": tok.encode(rendered, add_special_tokens=False),
                         "multi_modal_data": data}, params, use_tqdm=False)[0]
    assert want.error is None, want.error
    assert want.prompt_token_ids.count(llm.engine.mm_encoder.config.audio_token_id) == 15 + 20
    got = llm.chat(msg, params, use_tqdm=False)[0]
    assert got.prompt_token_ids == want.prompt_token_ids and got.outputs[0].token_ids == want.outputs[0].token_ids
    with live_server(path, engine_kw=kw) as server:
        r = chat(server, msg)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want.outputs[0].text
        assert r.json()["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        for content, needle in (
                ([_input_audio(wav_bytes(tone(8.0, 1)))], "maximum context length is 256 tokens; the prompt has 260"),
                ([_input_audio(wav_bytes(tone(31.0, 1)))], "audio 0 is 31.00 s long"),
                ([_input_audio(b"RIFF not a wave file at all")], "audio 0 could not be decoded"),
                ([parts[0], {"type": "audio_url", "audio_url": {"url": f"file://{root}/../x.wav"}}],
                 "is not under allowed_local_media_path"),
                ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
                 "takes audio alone")):
            r = chat(server, [{"role": "user", "content": [*content, {"type": "text", "text": "hi"}]}])
            assert r.status_code == 400 and needle in r.text, (needle, r.text)
        assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0
