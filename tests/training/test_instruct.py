"""Instruction data: loss only on answers (== a hand computation on a two-example batch), masked
positions get no gradient, chat-template rendering labels exactly the assistant turns, training
runs on it, and a conversation file without a template is refused before anything is written."""

from __future__ import annotations

import json

import pytest
import torch

import torchformer as tfm
from torchformer.training import recipe as recipes
from torchformer.training.batches import IGNORE, n_targets
from torchformer.training.instruct import InstructBatches, prepare
from torchformer.training.losses import CausalLM
from torchformer.training.train import train

from .tiny import tiny_recipe

PAIRS = [{"prompt": "Q: two plus two?\nA: ", "completion": "four"}, {"prompt": "Say hi: ", "completion": "hello there"}]
CHAT = [
    {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello!"},
            {"role": "user", "content": "bye"},
            {"role": "assistant", "content": "farewell"},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "name?"},
            {"role": "assistant", "content": "tf"},
        ]
    },
]
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if m.role == 'assistant' %}</s>{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _recipe(tmp_path, source, **data):
    return tiny_recipe(tmp_path / "out", source, data={"instruct": True, **data}, train={"batch_size": 2})


def _model(vocab):
    torch.manual_seed(0)
    cfg = tfm.presets.get("shakespeare-char")
    return tfm.build_model(
        cfg.replace(vocab_size=vocab, d_model=32, n_layers=1, attention=cfg.attention.__class__(n_heads=2))
    )


def test_loss_equals_hand_computation_on_two_examples(tmp_path):
    data = prepare(_recipe(tmp_path, _write(tmp_path / "p.jsonl", PAIRS * 5)), None)
    tok = data.tokenizer
    model = _model(tok.vocab_size)
    examples = data.train[:2]  # the two different pairs, different lengths (padding in the batch)
    batch = InstructBatches(data, batch_size=2, seq_len=64, seed=0).collate(examples)
    assert n_targets(batch) == sum(len(tok.encode(p["completion"])) + 1 for p in PAIRS)  # answers + EOS
    loss = CausalLM(model)(batch)
    hand = 0.0
    for pair in PAIRS:  # one example at a time, no padding: -log p of each completion token and the EOS
        prompt, answer = list(tok.encode(pair["prompt"])), [*tok.encode(pair["completion"]), tok.eos_id]
        seq = torch.tensor([prompt + answer])
        logp = torch.log_softmax(model(seq[:, :-1])[0].double(), -1)  # (T, V)
        hand -= sum(float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(answer))
    assert float(loss) == pytest.approx(hand, rel=1e-5)


def test_masked_positions_carry_no_gradient(tmp_path):
    data = prepare(_recipe(tmp_path, _write(tmp_path / "p.jsonl", PAIRS * 5)), None)
    model = _model(data.tokenizer.vocab_size)
    batch = InstructBatches(data, batch_size=2, seq_len=64, seed=0).collate(data.train[:2])
    logits = model(batch["ids"]).detach().requires_grad_(True)
    from torchformer.training.losses import token_loss

    token_loss(logits, batch["labels"]).backward()
    per_position = logits.grad.abs().sum(-1)  # (B, T)
    masked = batch["labels"] == IGNORE
    assert masked.any() and (~masked).any()
    assert torch.all(per_position[masked] == 0)
    assert torch.all(per_position[~masked] > 0)


def test_chat_template_labels_exactly_the_assistant_turns(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    data = prepare(_recipe(tmp_path, _write(tmp_path / "c.jsonl", CHAT * 5), chat_template=str(template)), None)
    tok = data.tokenizer
    ids, labels = data.train[0]
    text = tok.decode(ids)
    # (rendered as transformers does: trim_blocks drops the newline after each block tag)
    assert text == "<user>hi<assistant>hello!</s><user>bye<assistant>farewell</s>"
    learned = tok.decode(ids[labels != IGNORE])
    assert learned == "hello!</s>farewell</s>"  # each assistant turn as the template closes it


def test_training_runs_on_instruction_data(tmp_path):
    source = _write(tmp_path / "p.jsonl", PAIRS * 10)
    result = train(
        tiny_recipe(
            tmp_path / "out", source, data={"instruct": True}, train={"steps": 30, "batch_size": 4, "eval_every": 30}
        )
    )
    assert result.metrics[-1]["val_loss"] < result.metrics[0]["val_loss"]


def test_messages_without_template_refused_nothing_written(tmp_path):
    source = _write(tmp_path / "c.jsonl", CHAT * 5)
    with pytest.raises(ValueError, match=r"holds conversations .* but there is no chat template"):
        train(_recipe(tmp_path, source))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "line, match",
    [
        ('{"messages": [{"role": "user", "content": "x"}]}', "no 'assistant' message"),
        ('{"prompt": "x"}', r'expected \{"messages"'),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_lines_named(tmp_path, line, match):
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps(PAIRS[0]) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=rf"bad.jsonl:2: .*{match}"):
        prepare(_recipe(tmp_path, source), None)


def test_instruct_recipe_checks():
    with pytest.raises(ValueError, match="data.instruct=true: needs data.task 'lm'"):
        recipes.check(recipes.from_dict({"data": {"instruct": True, "task": "mlm"}}))


def test_answer_tokens_counted_across_micro_batches(tmp_path):
    """Rows with very different answer lengths: 2 micro-batches give the gradient of one batch
    (loss / answer tokens of the whole batch), with the model under LoRA as in fine-tuning."""
    import contextlib

    from torchformer.training.distributed import Runtime
    from torchformer.training.train import accumulate

    rows = [{"prompt": "p" * n, "completion": "c" * m} for n, m in [(3, 1), (1, 9), (6, 2), (2, 5)] * 3]
    data = prepare(_recipe(tmp_path, _write(tmp_path / "r.jsonl", rows)), None)
    objective = CausalLM(tfm.lora.apply(_model(data.tokenizer.vocab_size), rank=2, targets=("q_proj", "mlp.up")))
    batch = InstructBatches(data, batch_size=4, seq_len=64, seed=0).collate(data.train[:4])
    cpu = Runtime(rank=0, world=1, device=torch.device("cpu"))
    grads = []
    for accum in (1, 2):
        objective.zero_grad()
        accumulate(objective, batch, cpu, accum, contextlib.nullcontext)
        grads.append({n: p.grad.clone() for n, p in objective.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and all(".lora_" in n for n in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=0, msg=name)
