"""The fine-tuning plan: built once from the recipe, consulted by train() where the loop needs it.

A run from scratch has the empty plan: every parameter trains, a checkpoint holds every weight,
the run folder gets nothing more. Fine-tuning sets what differs (the words are finetune.py's):

  init      model.init, the model the run starts from, and its tokenizer (the data's)
  lora      which parameters train: the adapters alone (finetune.lora), over a base that
            finetune.quantize may quantize (QLoRA)
  record    what each checkpoint holds besides the adapters: the base they were trained over
            (state.json's "finetune" entry); a resume over another base is refused
  finish    what the run folder gets at the end: the merged model and a PEFT adapter (LoRA),
            eval.json (data.eval_file)
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from .. import lora as lora_room
from ..atomic import write_file
from ..evaluation.perplexity import text_perplexity
from ..lora import LoRASpec
from ..models.saving import WEIGHTS_FILE, unique_state
from . import finetune
from .checkpoint import ADAPTERS, STATE
from .data import read_utf8

EVAL_FILE = "eval.json"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    init: str | None = None  # model.init: a folder or GGUF file (None: built from the recipe's config)
    tokenizer: str | None = None  # model.init's tokenizer.json text: the data is tokenized with it
    lora: LoRASpec | None = None  # None: every parameter trains
    quantize: str | None = None  # the frozen base under the adapters: int8 | int4
    group_size: int | None = None
    reference: str | None = None  # DPO's frozen reference (None: the model as it starts)
    record: dict | None = None  # each checkpoint's "finetune" entry (None: a full checkpoint)
    eval_file: str | None = None  # data.eval_file, scored into eval.json at the end
    seed: int = 0  # the adapters' A matrices: the same start on every rank and every run

    @classmethod
    def of(cls, recipe) -> Plan:
        """The recipe's plan, checked before any data or folder is written: the LoRA targets exist
        (on the meta device), a quantized init trains only adapters, model.init has a tokenizer."""
        finetune.check(recipe)
        ft = recipe.finetune
        record = None
        if ft.lora is not None:
            quantized = None if ft.quantize is None else {"scheme": ft.quantize, "group_size": ft.group_size}
            record = {"lora": ft.lora.to_dict(), "base": recipe.model.get("init"), "quantize": quantized}
        return cls(
            init=finetune.init_of(recipe),
            tokenizer=finetune.init_tokenizer(recipe),
            lora=ft.lora,
            quantize=ft.quantize,
            group_size=ft.group_size,
            reference=ft.reference,
            record=record,
            eval_file=recipe.data.eval_file,
            seed=recipe.train.seed,
        )

    # -- the model --------------------------------------------------------------------------
    def base(self, recipe, device: torch.device, vocab_size: int) -> nn.Module | None:
        """model.init with the recipe's safe changes, on ``device``; None: build from the config."""
        return None if self.init is None else finetune.load_init(recipe, device, vocab_size)

    def reference_model(self, recipe, device: torch.device, vocab_size: int) -> nn.Module | None:
        """DPO's frozen reference (finetune.reference); None: the model as it starts."""
        return None if self.reference is None else finetune.load_reference(recipe, device, vocab_size)

    def adapt(self, model: nn.Module) -> nn.Module:
        """finetune.lora: the base quantized (finetune.quantize; round to nearest, so a resume
        rebuilds the same base), then adapters on the targets; only they train."""
        if self.lora is None:
            return model
        finetune.quantize_base(model, self.quantize, self.group_size)
        torch.manual_seed(self.seed)
        self._adapters(model)
        return model.train()  # quantize() leaves the model in eval mode; the wrapped quantized layers stay so

    def _adapters(self, model: nn.Module) -> None:
        s = self.lora
        lora_room.apply(model, rank=s.rank, alpha=s.alpha, targets=s.targets, dropout=s.dropout)

    # -- what a checkpoint holds ------------------------------------------------------------
    def checkpoint_weights(self, model: nn.Module, weights: dict) -> tuple[str, dict]:
        """(file name, tensors) a checkpoint holds: every weight, or the adapters alone for LoRA."""
        if self.lora is None:
            return "", weights
        names = set(lora_room.adapter_state(model))
        return ADAPTERS, {k: v for k, v in weights.items() if k in names}

    def load_weights(self, model: nn.Module, state: dict, load_full) -> None:
        (load_full if self.lora is None else lora_room.load_state)(model, state)

    def check_resume(self, checkpoint: Path) -> None:
        """Adapters resume only over the base they were trained over (same init, LoRA, quantization)."""
        file = Path(checkpoint) / STATE
        saved = json.loads(file.read_text()).get("finetune") if file.is_file() else None  # no file: restore says so
        if saved is not None and "quantize" not in saved:  # written before finetune.quantize existed: a float base
            saved = {**saved, "quantize": None}
        if saved != self.record:
            raise ValueError(
                f"--resume {checkpoint}: its adapters were trained with finetune {saved} but this recipe asks for "
                f"{self.record}; resume with the recipe's model.init and finetune section (lora, quantize, "
                "group_size) unchanged"
            )

    # -- what the run folder gets at the end ------------------------------------------------
    def finish(self, recipe, model: nn.Module, tok, out: Path) -> dict | None:
        """The LoRA run's merged model and PEFT adapter; data.eval_file's score (returned)."""
        if self.lora is not None:
            self._export(recipe, model, out)
        return None if self.eval_file is None else self._evaluate(recipe, model, tok, out)

    def _export(self, recipe, model: nn.Module, out: Path) -> None:
        """The merged model (model.safetensors beside config.json, so tfm.load, generate and eval
        open the run as any other) and, where the model has a Hugging Face family, the adapter in
        PEFT format under <out_dir>/adapter; checkpoints stay adapters only. QLoRA: the adapters
        are merged into the float model.init, as QLoRA users do; its logits differ from the
        trained model's by the quantization error of the base."""
        try:
            merged = lora_room.merge(self._float_copy(recipe, model))
        except ValueError as err:  # a quantized base cannot be merged: the run folder keeps the adapters
            logger.warning("LoRA run %s: not merged (%s)", out, err)
        else:
            state = unique_state(merged)
            write_file(out / WEIGHTS_FILE, lambda tmp: save_file(state, str(tmp)))
        try:
            lora_room.save(model, out / "adapter", base_model=recipe.model.get("init"))
        except ValueError as err:  # no HF family fits this model, or a fused layout
            logger.info("LoRA run %s: no PEFT adapter written (%s)", out, err)

    def _float_copy(self, recipe, model: nn.Module) -> nn.Module:
        """A copy whose base can take the adapters: for QLoRA from model.init, the float init with
        the same adapters (a preset base was never float after quantizing: merge refuses)."""
        if self.quantize is None or self.init is None:
            return copy.deepcopy(model)
        base = finetune.load_init(recipe, next(model.parameters()).device, model.config.vocab_size)
        self._adapters(base)
        lora_room.load_state(base, lora_room.adapter_state(model))
        return base

    def _evaluate(self, recipe, model: nn.Module, tok, out: Path) -> dict:
        """data.eval_file: strided perplexity (stride = half the context) and bits per byte."""
        seq_len = min(recipe.data.seq_len, model.config.max_seq_len)
        text = read_utf8(Path(self.eval_file))
        score = text_perplexity(model, tok, text, seq_len=seq_len, stride=max(1, seq_len // 2))
        result = {"eval_file": str(self.eval_file), **score.to_dict()}
        write_file(out / EVAL_FILE, lambda tmp: tmp.write_text(json.dumps(result) + "\n"))
        return result
