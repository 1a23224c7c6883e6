"""A tiny byte-level BPE tokenizer (GPT-2's byte alphabet, as SmolLM2 and Llama 3 use):
the 256 bytes, 4 special tokens and merges learned from a little JSON and prose."""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_SIZE = 320
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0-3: pad, bos 1, eos 2 (the tiny configs')
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def _corpus() -> list[str]:
    records = [{"name": "Ada", "age": 36, "ok": True, "tags": ["a", "b"]},
               {"city": "Paris", "temperature": 21.5, "sunny": False, "note": None},
               {"answer": "yes", "score": 0.75, "items": [1, 2, 3]}]
    text = [json.dumps(r) for r in records] + [json.dumps(r, separators=(",", ":")) for r in records]
    text += ["the quick brown fox jumps over the lazy dog", "yes no maybe positive negative",
             "2024-01-31T12:00:00Z café naïve 東京 🙂"]
    return text * 4


def build_byte_tokenizer(folder: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json (with a chat template) to ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    assert tok.get_vocab_size() <= VOCAB_SIZE
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
