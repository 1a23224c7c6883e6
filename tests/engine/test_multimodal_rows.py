"""engine/multimodal.py's pieces: which rows a step takes, the chain digest, the encode
batch, and the chat-template check (no model)."""

from __future__ import annotations

import pytest
import torch

from flashpage.engine.multimodal import (
    MultiModalInput,
    as_text_parts,
    chain_digest,
    encode_pending,
    overlapping,
    step_rows,
    template_reads_parts,
)


def _inputs() -> list[MultiModalInput]:
    a = MultiModalInput(3, 4, b"a" * 32, None, torch.arange(4.0)[:, None] + 100)
    b = MultiModalInput(9, 2, b"b" * 32, None, torch.arange(2.0)[:, None] + 200)
    return [a, b]


@pytest.mark.parametrize("start, end, want", [
    (0, 3, []),  # before the first image
    (0, 4, [(3, [100])]),  # its first row only
    (4, 10, [(0, [101, 102, 103]), (5, [200])]),  # the rest of a, the start of b
    (7, 9, []),  # between the two
    (10, 20, [(0, [201])]),
    (0, 20, [(3, [100, 101, 102, 103]), (9, [200, 201])]),
])
def test_step_rows_take_each_overlap(start, end, want):
    got = [(i, r[:, 0].tolist()) for i, r in step_rows(_inputs(), start, end)]
    assert got == want
    assert len(overlapping(_inputs(), start, end)) == len(want)


def test_chain_digest_names_data_and_positions():
    a, b = _inputs()
    moved = MultiModalInput(4, 4, a.digest, None)
    other = MultiModalInput(3, 4, b"c" * 32, None)
    digests = {chain_digest([a, b]), chain_digest([b, a]), chain_digest([a]), chain_digest([moved, b]),
               chain_digest([other, b])}
    assert len(digests) == 5
    assert chain_digest([a, b]) == chain_digest(_inputs())


def test_encode_pending_checks_the_encoders_rows():
    class Enc:
        def __init__(self, rows: int) -> None:
            self.rows = rows
            self.calls: list[int] = []

        def prepare(self, ids, data):
            raise NotImplementedError

        def encode(self, data):
            self.calls.append(len(data))
            return [torch.zeros(self.rows, 2) for _ in data]

    inputs = [MultiModalInput(0, 3, b"x", torch.zeros(1)), MultiModalInput(5, 3, b"y", torch.zeros(1))]
    enc = Enc(3)
    encode_pending(enc, inputs)
    assert enc.calls == [2] and all(mi.rows is not None and mi.data is None for mi in inputs)
    encode_pending(enc, [])
    assert enc.calls == [2]
    with pytest.raises(RuntimeError, match="4 rows for an input of 3 positions"):
        encode_pending(Enc(4), [MultiModalInput(0, 3, b"x", torch.zeros(1))])
    # batches of at most max_rows rows (what the engine reserved memory for); one input
    # longer than that alone
    enc = Enc(3)
    five = [MultiModalInput(4 * i, 3, bytes([i]), torch.zeros(1)) for i in range(5)]
    encode_pending(enc, five, max_rows=7)
    assert enc.calls == [2, 2, 1] and all(mi.rows is not None for mi in five)
    enc = Enc(3)
    encode_pending(enc, [MultiModalInput(0, 3, b"a", torch.zeros(1)), MultiModalInput(3, 3, b"b", torch.zeros(1))],
                   max_rows=2)
    assert enc.calls == [1, 1]


def test_template_reads_parts():
    assert template_reads_parts("{% for c in message['content'] %}{{ c['text'] }}{% endfor %}")
    assert template_reads_parts("{% for c in message['content'] | selectattr('type', 'equalto', 'text') %}")
    assert template_reads_parts("{% for part in message.content %}{% endfor %}")
    assert template_reads_parts("{% for c in m['content'] %}{% endfor %}")
    assert not template_reads_parts("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert not template_reads_parts("{{ message['content'] | trim }}")
    assert not template_reads_parts(None) and not template_reads_parts({"default": "x"})
    conv = [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "x"}]}]
    assert as_text_parts(conv) == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, conv[1]]
