"""The server takes the model's generation_config.json defaults for the sampling fields a
request leaves unset, and its max_new_tokens as a cap (vLLM's --generation-config auto)."""

from __future__ import annotations

import json
import shutil

from tests.server.conftest import live_server
from tests.server.test_errors import post


def test_unset_fields_take_the_models_defaults(tiny_model_dir, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    with live_server(d) as s:
        body = {"prompt": "the quick brown fox", "max_tokens": 10, "n": 3, "ignore_eos": True}
        r = post(s, "/v1/completions", body)
        assert r.status_code == 200, r.text
        texts = [c["text"] for c in r.json()["choices"]]
        assert len(set(texts)) == 1  # greedy: the model's temperature 0
        assert r.json()["usage"]["completion_tokens"] == 9  # 3 each: the cap
        sampled = post(s, "/v1/completions", {**body, "temperature": 1.5, "seed": 1})
        assert len({c["text"] for c in sampled.json()["choices"]}) > 1  # the request's own wins
        beams = post(s, "/v1/completions", {**body, "use_beam_search": True})  # capped too
        assert beams.status_code == 200 and beams.json()["usage"]["completion_tokens"] == 9
