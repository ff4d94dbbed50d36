"""Models of a known shape with random weights, and a tokenizer that decodes every id: a step's
speed does not depend on the weights' values, so a GPU box with no hub and no model files can still
time the engine at the shape it will serve."""
from __future__ import annotations

import itertools

import torch

SHAPES = {  # LlamaConfig fields of each shape (its published config.json)
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
}
EOS_ID = 2


def random_model(shape: str, device: torch.device, dtype: torch.dtype):
    """A `LlamaForCausalLM` of the named shape, seeded random weights, made on `device` (a 7B model's
    initialisation takes minutes on a CPU and seconds on a GPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"shape: '{shape}' is not one of {', '.join(SHAPES)}")
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def words():
    """Pronounceable words, all 4-letter ones first ('baba', 'babe', ...), then 6-letter ones: none
    inside another across a space, so text offsets and stop strings are easy to reason about."""
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    return ("".join(parts) for n in (2, 3) for parts in itertools.product(syllables, repeat=n))


def word_tokenizer(vocab_size: int, leading: tuple[str, ...] = ("<unk>", "<s>", "</s>"), bos: str = "<s>",
                   eos: str = "</s>"):
    """A word-level fast tokenizer with exactly `vocab_size` ids: `leading` (`<unk>` first), then
    `words()`, so any id a random model picks decodes as the engine's detokenizer needs."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = list(leading) + list(itertools.islice(words(), vocab_size - len(leading)))
    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token=bos, eos_token=eos,
                                   clean_up_tokenization_spaces=False)


def piece_tokenizer(pieces: list[str]):
    """A fast tokenizer whose ids decode to exactly their pieces, concatenated: "<unk>", "<|im_start|>"
    (bos) and "<|im_end|>" (eos, id 2), then `pieces` in order (each once). For grammar tests, whose
    pieces must span a grammar's boundaries as a real vocabulary's do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = ["<unk>", "<|im_start|>", "<|im_end|>"] + list(pieces)
    if len(set(tokens)) != len(tokens):
        raise ValueError("pieces: each piece once (a repeated one would leave an id that decodes to nothing)")
    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", clean_up_tokenization_spaces=False)
