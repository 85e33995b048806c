"""Issue 30: preference tuning end to end. Sequence log-probs from padded pair batches equal each
sequence scored alone; the LoRA reference is exactly the base (adapters off, no copy); a short DPO
run on the synthetic sorting task lifts held-out accuracy from chance to >= 90%; accumulation equals
one batch; resume is bit-exact; SimPO and ORPO train; conversations go through the chat template;
finetune.reference names another model."""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch

from torchformer import lora
from torchformer.training import recipe as recipes
from torchformer.training.batches import IGNORE, n_targets
from torchformer.training.distributed import Runtime
from torchformer.training.preference import DPO, Preference, sequence_logps
from torchformer.training.preference_data import PreferenceBatches, prepare
from torchformer.training.recipe_files import apply_overrides, read_file
from torchformer.training.train import accumulate, train

from .test_instruct import _model

CPU = Runtime(rank=0, world=1, device=torch.device("cpu"))
SMALL = ["model.d_model=32", "model.n_layers=1", "model.attention.n_heads=2", "model.block.d_ff=64",
         "train.device=cpu", "train.max_time_s=null", "data.synthetic.n_train=400", "data.synthetic.n_val=64",
         "train.batch_size=8", "train.eval_batches=8", "train.log_every=5"]  # fmt: skip


def _recipe(tmp_path, *extra, name="run", init=None):
    """The dpo-tiny recipe, shrunk; ``init``: start from that run folder (the model section is then
    model.init alone, as fine-tuning requires)."""
    raw = apply_overrides(read_file("dpo-tiny"), [*SMALL, f"train.out_dir={tmp_path / name}", *extra])
    if init is not None:
        raw["model"] = {"init": str(init)}
    return recipes.from_dict(raw)


def test_sequence_logps_equal_each_sequence_alone(tmp_path):
    data = prepare(_recipe(tmp_path), None)
    model = _model(data.tokenizer.vocab_size).eval()
    pairs = data.train[:4]  # different lengths: padding in the batch
    batch = PreferenceBatches(data, batch_size=4, seq_len=32, seed=0).collate(pairs)
    assert n_targets(batch) == 4 and batch["chosen"].tolist() == [True, False] * 4
    got = sequence_logps(model, batch)
    for i, (prompt, chosen, rejected) in enumerate(pairs):
        for answer, value, n in (
            (chosen, got.chosen[i], got.n_chosen[i]),
            (rejected, got.rejected[i], got.n_rejected[i]),
        ):
            seq = torch.tensor([[*prompt, *answer]])
            logp = torch.log_softmax(model(seq[:, :-1])[0].double(), -1)  # (T, V)
            hand = sum(float(logp[len(prompt) - 1 + j, t].detach()) for j, t in enumerate(answer))
            assert float(value.detach()) == pytest.approx(hand, abs=1e-4)
            assert int(n) == len(answer)  # the answer and its EOS, nothing of the prompt


def test_lora_reference_is_the_base_with_adapters_off_and_no_copy():
    model = _model(40)
    x = torch.randint(0, 40, (2, 10))
    with torch.no_grad():
        base = model(x)
    lora.apply(model, rank=4, alpha=8, targets=("q_proj", "v_proj", "mlp.up"))
    with torch.no_grad():
        for m in lora.adapters(model).values():
            m.lora_B.weight.normal_()  # adapters that change the output
        adapted = model(x)
        with lora.disabled(model):
            off = model(x)
        again = model(x)
    assert not torch.allclose(adapted, base, atol=1e-3)
    assert torch.equal(off, base)  # the frozen base exactly
    assert torch.equal(again, adapted)  # and the adapters are back
    objective = Preference(model, DPO())  # DPO over LoRA: no reference module, no second copy of the weights
    assert objective.reference is None
    assert sum(p.numel() for p in objective.parameters()) == sum(p.numel() for p in model.parameters())


def test_dpo_run_lifts_heldout_accuracy_from_chance(tmp_path):
    """The shipped dpo-tiny recipe, shrunk: the untrained policy equals its reference (every reward
    0: accuracy 50%, chance); 60 steps later >= 90% of held-out pairs rank the sorted answer first
    (measured 100%). Bounded by its 60 steps, not a clock: ~10 s on a quiet machine, 1 thread."""
    result = train(_recipe(tmp_path, "train.steps=60", "train.eval_every=60"))
    first, last = result.metrics[0], result.metrics[-1]
    assert first["accuracy"] == 0.5 and first["val_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["reward_margin"] == 0.0
    assert last["accuracy"] >= 0.9, last
    assert last["reward_margin"] > 0 and last["val_loss"] < first["val_loss"]
    assert {"rewards_chosen", "rewards_rejected", "prefers_chosen"} <= last.keys()


def test_accumulation_equals_one_batch(tmp_path):
    data = prepare(_recipe(tmp_path), None)
    batch = PreferenceBatches(data, batch_size=8, seq_len=32, seed=0).batch(0)
    objective = Preference(
        _model(data.tokenizer.vocab_size), DPO(beta=0.5), reference=_model(data.tokenizer.vocab_size)
    )
    with torch.no_grad():  # a reference other than the policy: the loss is not ln 2 everywhere
        for p in objective.reference.parameters():
            p.add_(0.05 * torch.randn_like(p))

    def grads(accum):
        objective.zero_grad()
        loss, pairs = accumulate(objective, batch, CPU, accum, contextlib.nullcontext)
        return loss / pairs, {n: p.grad.clone() for n, p in objective.named_parameters() if p.grad is not None}

    loss1, g1 = grads(1)
    loss4, g4 = grads(4)
    assert loss4 == pytest.approx(loss1, abs=1e-6)
    assert g1 and g1.keys() == g4.keys()
    for name in g1:
        torch.testing.assert_close(g4[name], g1[name], atol=1e-6, rtol=0, msg=name)


def _weights(result):
    return {k: v.clone() for k, v in result.model.state_dict().items()}


@pytest.mark.parametrize("extra", [["model.dropout=0.1"], ["finetune.lora={rank: 4, alpha: 8, dropout: 0.1}"]])
def test_resume_is_bit_exact(tmp_path, extra):
    """Full fine-tuning (a frozen copy as reference) and LoRA (the base, adapters off), dropout on."""
    common = ["train.steps=8", "train.eval_every=4", "train.grad_accum=2", *extra]
    straight = train(_recipe(tmp_path, *common, name="a"))
    half = train(_recipe(tmp_path, *common, name="b"), stop_after=4)
    resumed = train(_recipe(tmp_path, *common, name="b"), resume="auto")
    a, b = _weights(straight), _weights(resumed)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert any(not torch.equal(v, _weights(half)[k]) for k, v in b.items())  # it trained after resuming
    assert [r["step"] for r in resumed.metrics] == [0, 4, 8]
    assert resumed.metrics == straight.metrics or all(
        r1["val_loss"] == r2["val_loss"] for r1, r2 in zip(resumed.metrics, straight.metrics)
    )


@pytest.mark.parametrize("objective", ["simpo", "orpo"])
def test_reference_free_objectives_train(tmp_path, objective):
    beta = {"simpo": 2.0, "orpo": 0.1}[objective]
    result = train(_recipe(tmp_path, f"train.objective={objective}", f"preference.beta={beta}", "train.steps=60",
                           "train.eval_every=60"))  # fmt: skip
    first, last = result.metrics[0], result.metrics[-1]
    assert last["val_loss"] < first["val_loss"]
    assert last["accuracy"] >= 0.9 and last["prefers_chosen"] >= 0.9, last


TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if m.role == 'assistant' %}</s>{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_conversations_go_through_the_chat_template(tmp_path):
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    rows = [
        {
            "messages": [{"role": "system", "content": "be kind"}, {"role": "user", "content": f"hi {i}"}],
            "chosen": [{"role": "assistant", "content": "hello!"}],
            "rejected": "go away",
        }
        for i in range(4)
    ]
    rows.append({"prompt": [{"role": "user", "content": "bye"}], "chosen": "farewell", "rejected": "whatever"})
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = _recipe(tmp_path, f"data.source={tmp_path / 'p.jsonl'}", f"data.chat_template={tmp_path / 'chat.jinja'}")
    data = prepare(r, None)
    tok = data.tokenizer
    prompt, chosen, rejected = data.train[0]
    assert tok.decode(prompt) == "<system>be kind<user>hi 0<assistant>"
    assert tok.decode(chosen) == "hello!</s>" and tok.decode(rejected) == "go away</s>"
    batch = PreferenceBatches(data, batch_size=1, seq_len=64, seed=0).collate([data.train[0]])
    learned = [tok.decode(labels[labels != IGNORE]) for labels in batch["labels"]]
    assert learned == ["hello!</s>", "go away</s>"]  # labels on the answers only
    assert tok.decode(data.val[0][0]) == "<user>bye<assistant>"  # "prompt" as a list of messages


def test_finetune_reference_names_another_model(tmp_path):
    """model.init and finetune.reference the same trained run: the policy starts equal to its
    reference (loss ln 2, accuracy 50%); a reference of another vocabulary is refused up front."""
    first = train(_recipe(tmp_path, "train.steps=10", "train.eval_every=10", name="sft"))
    init = str(first.out_dir)
    result = train(_recipe(tmp_path, f"finetune.reference={init}", "train.steps=2", "train.eval_every=2",
                           name="ref", init=init))  # fmt: skip
    assert result.metrics[0]["val_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert result.metrics[0]["accuracy"] == 0.5
    other = train(_recipe(tmp_path, "train.steps=1", "train.eval_every=1", "data.synthetic.alphabet=abcdefghijklmnop",
                          name="other"))  # fmt: skip
    assert other.model.config.vocab_size != first.model.config.vocab_size
    out = tmp_path / "refused"
    with pytest.raises(ValueError, match=r"finetune.reference=.* has vocab_size \d+, model.init=.*share the policy"):
        train(_recipe(tmp_path, f"finetune.reference={other.out_dir}", name="refused", init=init))
    assert not out.exists()


def test_ddp_two_processes_equal_one_and_only_rank_0_logs(tmp_path):
    """DPO on 2 CPU ranks (gloo; tests/parallel/launch.py ``ranks``: torchrun's environment): each
    rank takes whole pairs of the global batch and the weights equal one process's within 1e-5;
    only rank 0 writes a tracker's events."""
    import os

    from safetensors.torch import load_file

    from ..parallel.launch import ranks

    common = ["train.steps=4", "train.eval_every=4", "train.grad_accum=2"]
    single = train(_recipe(tmp_path, *common, name="single"))
    recipe_file = tmp_path / "ddp.json"
    ddp = _recipe(tmp_path, *common, "train.log_to=[tensorboard]", name="ddp")
    recipe_file.write_text(json.dumps(ddp.to_dict()))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = ranks(2, "torchformer.cli.main", "train", "--recipe", str(recipe_file), timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    weights = load_file(str(tmp_path / "ddp" / "model.safetensors"))
    ref = {k: v for k, v in single.model.state_dict().items() if k in weights}
    assert weights.keys() == ref.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, ref[name], atol=1e-5, rtol=0, msg=name)
    assert len(list((tmp_path / "ddp" / "tensorboard").glob("events.out.tfevents.*"))) == 1
