"""Write a tiny Llama model directory that real vLLM serves: config, tokenizer and weights.

Runs inside the vLLM venv (it needs `tokenizers`, `torch` and `safetensors`, which pdproxy
does not depend on). Nothing is downloaded: the config is written by hand, and a byte-level
BPE tokenizer is trained here, offline, on generated text, to exactly the model's vocabulary
size, so every id the model can sample decodes to text. The tokenizer carries a chat template
so /v1/chat/completions works. The weights are seeded random normals, scaled so that the next
token really depends on the whole prompt: vLLM's `--load-format dummy` weights are so small
that every logit is about equal, and an answer computed from wrong KV would look the same as
one computed from the right KV.

    VLLM_VENV/bin/python tests/harness/tiny_model.py DIR   (by path: see vllm_cpu.tiny_model_dir)
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

VOCAB_SIZE = 1000
SPECIAL_TOKENS = ("<|begin|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>")
BOS, EOS = SPECIAL_TOKENS[0], SPECIAL_TOKENS[1]
# head_dim 32: the CPU attention backend refuses 16 (measured), and 32 keeps the model tiny.
MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_SYLLABLES = (
    *("ka", "ri", "to", "mu", "ne", "sa", "lo", "vi", "pe", "da", "zu", "an", "el", "or"),
    *("is", "ut", "qua", "ten", "ber", "gon", "fil", "mar", "sed", "tro", "plin", "wes"),
    *("hok", "dra", "yim", "cus", "nef", "obi", "rel", "stam", "gru"),
)


def _corpus(lines: int = 4000, seed: int = 7) -> list[str]:
    """Deterministic pseudo-words: varied enough to learn ~740 merges."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))) for _ in range(3000)]
    punctuation = (".", ",", "!", "?", ";", ":")
    return [
        " ".join(rng.choices(words, k=rng.randint(4, 16))) + rng.choice(punctuation)
        for _ in range(lines)
    ]


def write_tiny_model(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    size = tokenizer.get_vocab_size()
    if size != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {size} tokens, the model {VOCAB_SIZE}")
    if [tokenizer.token_to_id(t) for t in (BOS, EOS)] != [0, 1]:
        raise RuntimeError("special tokens did not get ids 0 and 1")
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": False,
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(directory / "tokenizer_config.json", tokenizer_config)
    _write_json(directory / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS})
    _write_json(directory / "config.json", MODEL_CONFIG)
    generation = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}
    _write_json(directory / "generation_config.json", generation)
    _write_weights(directory / "model.safetensors")


def _write_weights(path: Path, seed: int = 11) -> None:
    import torch
    from safetensors.torch import save_file

    config = MODEL_CONFIG
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim
    generator = torch.Generator().manual_seed(seed)

    def normal(rows: int, cols: int, scale: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator) * scale

    fan = hidden**-0.5
    weights = {
        "model.embed_tokens.weight": normal(VOCAB_SIZE, hidden, 1.0),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": normal(VOCAB_SIZE, hidden, 4 * fan),
    }
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        # Sharp attention (large q and k) makes every position's KV matter to the answer.
        weights |= {
            prefix + "self_attn.q_proj.weight": normal(q_out, hidden, 3 * fan),
            prefix + "self_attn.k_proj.weight": normal(kv_out, hidden, 3 * fan),
            prefix + "self_attn.v_proj.weight": normal(kv_out, hidden, fan),
            prefix + "self_attn.o_proj.weight": normal(hidden, q_out, fan),
            prefix + "mlp.gate_proj.weight": normal(inner, hidden, fan),
            prefix + "mlp.up_proj.weight": normal(inner, hidden, fan),
            prefix + "mlp.down_proj.weight": normal(hidden, inner, inner**-0.5),
            prefix + "input_layernorm.weight": torch.ones(hidden),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, str(path))


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")


if __name__ == "__main__":
    write_tiny_model(Path(sys.argv[1]))
