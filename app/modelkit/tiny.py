"""`llmq model build-tiny DIR`: a 2-layer random-weight Llama with a byte-level BPE tokenizer
trained on the spot and a ChatML template. Built in seconds, no downloads; for tests.

Head size is 64 (hidden 256, 4 heads): vLLM's CPU attention refuses head size 16.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

VOCAB_SIZE = 1024
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "def main():\n    print('hello world')\n    return 0\n",
    '{"name": "Alice", "age": 30, "tags": ["a", "b"], "ok": true, "x": null}',
    "Queue-based batch inference: requests are pulled from a queue and answered.",
    "0123456789 + - * / = < > ( ) [ ] { } , . ; : ! ? ' \" \\ | @ # $ % ^ & _ ~ `",
    "user assistant system tool function arguments content role",
    "Grüße, café, naïve, 東京, Москва, emoji 🙂🚀",
]


def _corpus() -> list[str]:
    """A fixed text plus a few stdlib sources: enough for ~1,000 merges, all offline."""
    import argparse
    import json as json_module
    import textwrap

    texts = _CORPUS * 20
    texts += [inspect.getsource(m) for m in (json_module, argparse, textwrap)]
    return texts


def build_tiny(out: Path, *, seed: int = 0, max_position_embeddings: int = 2048) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: no unknown token
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        model_max_length=max_position_embeddings,
    )
    fast.chat_template = CHATML
    bos, eos, pad = fast.bos_token_id, fast.eos_token_id, fast.pad_token_id
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    # Older loaders read the template from tokenizer_config.json only.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if "chat_template" not in cfg:
        cfg["chat_template"] = CHATML
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return out
