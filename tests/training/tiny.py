import random

from torchformer.training import recipe as recipes


def words_text(n_lines: int, seed: int = 0) -> str:
    """Deterministic pseudo-dialogue: enough structure that a tiny model can learn something."""
    rng = random.Random(seed)
    names = ["ROMEO", "JULIET", "NURSE", "FRIAR"]
    vocab = ["the", "and", "of", "to", "my", "thou", "thee", "love", "night", "day", "sweet", "good", "lord"]
    lines = []
    for _ in range(n_lines):
        lines.append(rng.choice(names))
        lines.append(" ".join(rng.choice(vocab) for _ in range(rng.randint(3, 9))) + rng.choice(".,;!?"))
        lines.append("")
    return "\n".join(lines)


TINY_MODEL = {
    "preset": "shakespeare-char",
    "d_model": 32,
    "n_layers": 2,
    "max_seq_len": 64,
    "attention": {"n_heads": 2},
}


def tiny_recipe(out_dir, source, **sections) -> recipes.Recipe:
    """A seconds-long recipe: tiny model, short sequences, few steps. sections: dicts merged per section."""
    raw = {
        "name": "tiny",
        "model": dict(TINY_MODEL),
        "data": {"source": str(source), "task": "lm", "tokenizer": "char", "seq_len": 16},
        "optim": {"lr": 3e-3},
        "schedule": {"name": "cosine", "warmup": 5},
        "train": {
            "steps": 20,
            "batch_size": 8,
            "eval_every": 10,
            "eval_batches": 2,
            "log_every": 5,
            "out_dir": str(out_dir),
            "device": "cpu",
        },
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values} if isinstance(values, dict) else values
    return recipes.from_dict(raw)


TINY_SEQ2SEQ = {
    "preset": "vanilla-base",
    "d_model": 32,
    "n_layers": 2,
    "n_decoder_layers": 2,
    "max_seq_len": 32,
    "attention": {"n_heads": 2},
    "block": {"d_ff": 64, "dropout": 0.1},
    "dropout": 0.1,
}


def tiny_seq2seq(out_dir, **sections) -> recipes.Recipe:
    synth = {"n_train": 400, "n_val": 40, "min_len": 2, "max_len": 8, "alphabet": "abcdef"}
    base = {
        "model": dict(TINY_SEQ2SEQ),
        "data": {"source": "reverse", "task": "seq2seq", "synthetic": synth},
        "schedule": {"name": "noam", "warmup": 10, "factor": 2.0},
        "train": {"label_smoothing": 0.1, "batch_size": 16},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return tiny_recipe(out_dir, "reverse", **base)


def tiny_hf_llama(folder):
    """A tiny random HF Llama saved in ``folder`` with a tokenizer.json (torchformer's byte-level
    tokenizer): a model.init for fine-tuning tests. Returns the folder."""
    import torch
    import transformers as T

    from torchformer.training.tokenizers import build_tokenizer

    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=272, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    T.LlamaForCausalLM(cfg).save_pretrained(folder)
    (folder / "tokenizer.json").write_text(build_tokenizer("byte", "").to_json())
    return folder
