"""Tiny random Hugging Face models, one per family variant, built offline from config objects and
saved once per session (importing transformers and building models is the slow part)."""

from __future__ import annotations

import pytest
import torch
import transformers as T

DECODER = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
DECODER_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=128)
SEQ2SEQ = dict(
    vocab_size=128,
    d_model=64,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=96,
    decoder_ffn_dim=96,
    max_position_embeddings=64,
)

# name -> (config, model class). GQA wherever the family has it; the variants cover tied and
# untied heads, biases, a non-default RoPE base, sliding windows and both BART/Marian flavours.
SPECS = {
    "llama": lambda: (T.LlamaConfig(**DECODER, **DECODER_IDS, num_key_value_heads=2), T.LlamaForCausalLM),
    "llama-tied-bias-mqa": lambda: (
        T.LlamaConfig(
            **DECODER,
            **DECODER_IDS,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
            rms_norm_eps=1e-5,
            initializer_range=0.5,  # tied tiny models at 0.02 repeat one token; 0.5 makes greedy varied
        ),
        T.LlamaForCausalLM,
    ),
    "mistral": lambda: (
        T.MistralConfig(**DECODER, **DECODER_IDS, num_key_value_heads=2, sliding_window=8),
        T.MistralForCausalLM,
    ),
    "qwen2": lambda: (T.Qwen2Config(**DECODER, **DECODER_IDS, num_key_value_heads=2), T.Qwen2ForCausalLM),
    "gpt2": lambda: (
        T.GPT2Config(
            vocab_size=128,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=128,
            bos_token_id=1,
            eos_token_id=2,
            initializer_range=0.5,
        ),
        T.GPT2LMHeadModel,
    ),
    "bert": lambda: (
        T.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96),
        T.BertModel,
    ),
    "bart": lambda: (T.BartConfig(**SEQ2SEQ, init_std=0.5), T.BartForConditionalGeneration),
    "marian": lambda: (
        T.MarianConfig(
            **SEQ2SEQ,
            activation_function="swish",
            scale_embedding=True,
            pad_token_id=127,
            decoder_start_token_id=127,
            eos_token_id=0,
            tie_word_embeddings=False,
            init_std=0.1,
        ),
        T.MarianMTModel,
    ),
}
SPECS["marian-tied"] = lambda: (
    T.MarianConfig(
        **SEQ2SEQ,
        activation_function="swish",
        scale_embedding=True,
        pad_token_id=127,
        eos_token_id=0,
        decoder_start_token_id=127,
    ),
    T.MarianMTModel,
)
DECODERS = ["llama", "llama-tied-bias-mqa", "mistral", "qwen2", "gpt2"]
SEQ2SEQS = ["bart", "marian", "marian-tied"]


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory):
    """hf_model(name) -> (folder, HF model in eval mode), built once per session."""
    cache: dict[str, tuple] = {}

    def make(name: str):
        if name not in cache:
            config, cls = SPECS[name]()
            torch.manual_seed(1234)
            model = cls(config).eval()
            folder = tmp_path_factory.mktemp(name)
            model.save_pretrained(folder)
            cache[name] = (folder, model)
        return cache[name]

    return make
