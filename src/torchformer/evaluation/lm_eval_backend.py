"""lm-evaluation-harness's ``torchformer`` model backend: any decoder ``tfm.load_any`` opens (a
torchformer checkpoint, a Hugging Face folder, a .gguf file), optionally cast or weight-quantized,
scored by lm-eval's tasks through its three request types, batched.

    lm_eval --model torchformer --model_args pretrained=DIR,dtype=bfloat16,quantize=int8 --tasks T

Requests are turned into tokens exactly as lm-eval's own ``hf`` backend does (``TemplateLM``'s
pair encoding, its rolling windows, its stop sequences), so the same model gives the same numbers
through either backend: tests/evaluation/test_lm_eval_backend.py checks that within 1e-4.
lm_eval is an optional dependency (the ``eval`` extra); this module imports it, nothing else in
torchformer imports this module except the callers that need it (lm_eval_run.py).
"""

from __future__ import annotations

import logging

import torch

from ..extras import require

require("lm_eval")  # MissingExtra naming torchformer[eval] when lm-eval is not installed
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.models.utils import (  # noqa: E402
    Collator,
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

NAME = "torchformer"
logger = logging.getLogger(__name__)
ARGS = "pretrained, dtype, quantize, group_size, batch_size, device, max_length, max_gen_toks"
SAMPLING = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")


class TorchformerLM(TemplateLM):
    """``pretrained``: what ``tfm.load_any`` opens (tokenizer.json beside it, or a .gguf file's own).
    dtype: bfloat16 | float16 | float32 | auto (as stored); quantize: int8 | int4 (group_size);
    batch_size: requests per forward; max_length: context tokens (default: the model's
    max_seq_len); max_gen_toks: generate_until's default budget."""

    def __init__(self, pretrained: str, *, dtype: str | None = None, quantize: str | None = None,
                 group_size: int | None = None, batch_size: int | str = 1, max_batch_size: int | None = None,
                 device: str | None = None, max_length: int | None = None, max_gen_toks: int = 256,
                 **unknown) -> None:  # fmt: skip
        from ..loading import has_tokenizer, load_any, load_tokenizer

        super().__init__()
        if unknown:
            raise ValueError(f"--model_args {sorted(unknown)}: unknown to the torchformer backend; it takes {ARGS}")
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.max_gen_toks = _positive_int(max_gen_toks, "max_gen_toks")
        if not has_tokenizer(pretrained):
            raise ValueError(f"pretrained={pretrained!r}: no tokenizer.json beside the model (nor a .gguf file)")
        self._device = _device(device)
        dtype = None if dtype in (None, "auto") else dtype
        self.model = load_any(pretrained, dtype=dtype, quantize=quantize, group_size=group_size,
                              device=str(self._device)).eval()  # fmt: skip
        cfg = self.model.config
        if cfg.arch != "decoder":
            raise ValueError(f"pretrained={pretrained!r} is an {cfg.arch} model; lm-eval's tasks need a decoder")
        self.tokenizer = load_tokenizer(pretrained)
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self.pretrained = str(pretrained)
        self.max_length = _positive_int(max_length, "max_length") if max_length is not None else cfg.max_seq_len
        eos = cfg.eos_token_id
        self._eot = eos[0] if isinstance(eos, list | tuple) else eos
        self._prefix = cfg.bos_token_id if cfg.bos_token_id is not None else self._eot
        self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else (self._eot or 0)

    @property
    def eot_token_id(self) -> int:
        if self._eot is None:
            raise ValueError(f"{self.pretrained}: the model's config names no eos_token_id (an empty context needs it)")
        return self._eot

    @property
    def prefix_token_id(self) -> int:
        return self._prefix if self._prefix is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.pretrained

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None, **kw):
        if add_special_tokens is None:  # the tokenizer's own post-processing, unless the text already has the BOS
            prefix = None if self._prefix is None else self.tokenizer.decode([self._prefix], skip_special_tokens=False)
            add_special_tokens = not (prefix and string.startswith(prefix))
        ids = self.tokenizer.encode(string, add_special_tokens=add_special_tokens).ids
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw) -> list[tuple[float, bool]]:
        """Each (key, context ids, continuation ids): the continuation's summed log-probability and
        whether greedy decoding reproduces it. Longest first, ``batch_size`` rows per forward,
        right-padded (causal attention: padding after a row changes nothing before it)."""
        order = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        out = []
        for chunk in order.get_batched(n=self.batch_size):
            rows = [(ctx + cont)[-(self.max_length + 1) :][:-1] for _, ctx, cont in chunk]  # inputs: all but the last
            ids = torch.full((len(rows), max(map(len, rows))), self.pad, dtype=torch.long)  # (B, T)
            for b, row in enumerate(rows):
                ids[b, : len(row)] = torch.tensor(row)
            with torch.inference_mode():
                hidden = self._hidden(ids.to(self._device))  # (B, T, D)
                for b, (key, _, cont) in enumerate(chunk):
                    end = len(rows[b])
                    logp = self.model.lm_head(hidden[b, end - len(cont) : end]).float().log_softmax(-1)  # (C, V)
                    target = torch.tensor(cont, device=logp.device)
                    answer = (float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all()))
                    out.append(answer)
                    if key is not None:
                        self.cache_hook.add_partial("loglikelihood", key, answer)
        return order.get_original(out)

    def _hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """The final hidden states (B, T, D) of unpadded-from-the-left rows at positions 0..T-1: the
        head runs only over the continuation's rows (a 2048-token window times a 150k vocabulary
        would be 1.2 GB of logits per row)."""
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return self.model.hidden(ids, pos, None, None, aligned=True)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's total log-probability: lm-eval's disjoint rolling windows of max_length
        tokens (the first conditioned on the prefix token), all texts' windows batched together."""
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            pieces = get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id, self.max_length, 1)
            for ctx, cont in map(make_disjoint_window, pieces):
                windows.append((None, ctx, cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled) continuations cut at the first stop sequence; requests with the same
        generation settings go ``batch_size`` at a time, left-padded."""
        from .lm_eval_generate import generate_batch

        order = Collator([r.args for r in requests], sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
                         group_by="gen_kwargs", group_fn=lambda r: r[1])  # fmt: skip
        eos = None if self._eot is None else self.tokenizer.decode([self._eot], skip_special_tokens=False)
        out = []
        for chunk in order.get_batched(n=self.batch_size):
            contexts, settings = zip(*chunk)
            kwargs = dict(normalize_gen_kwargs(settings[0], self.max_gen_toks))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            budget = kwargs.pop("max_gen_toks")
            unknown = sorted(set(kwargs) - set(SAMPLING))
            if unknown:
                raise ValueError(f"generation_kwargs {unknown}: not supported by the torchformer backend; "
                                 f"it takes until, max_gen_toks and {list(SAMPLING)}")  # fmt: skip
            if budget >= self.max_length:
                raise ValueError(f"max_gen_toks={budget}: must be below the model's max_length {self.max_length}")
            prompts = [self.tok_encode(c, left_truncate_len=self.max_length - budget) for c in contexts]
            texts = generate_batch(self, prompts, budget, until, kwargs)
            for context, setting, text in zip(contexts, settings, texts):
                text = postprocess_generated_text(text, stop=until, think_end_token=None)
                out.append(text)
                self.cache_hook.add_partial("generate_until", (context, setting), text)
        return order.get_original(out)

    def get_model_info(self) -> dict:
        p = next(self.model.parameters())
        return {"model_num_parameters": sum(q.numel() for q in self.model.parameters()), "model_dtype": str(p.dtype),
                "model_quantization": str(getattr(self.model, "quantization", None))}  # fmt: skip


def _device(name: str | None) -> torch.device:
    """``name``, or the GPU when there is one; lm-eval's command line passes "cuda" unless told
    otherwise, so on a machine without one that means the CPU (as its hf backend does)."""
    cuda = torch.cuda.is_available()
    if name is None or (name.startswith("cuda") and not cuda):
        if name is not None:
            logger.warning("device=%r: no CUDA device here; using the CPU", name)
        return torch.device("cuda" if cuda else "cpu")
    return torch.device(name)


def _positive_int(value, name: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or (isinstance(value, float) and value != number):
        raise ValueError(f"{name}={value!r}: must be a whole number >= 1 (the torchformer backend has no 'auto')")
    return number


def register() -> None:
    """Make ``torchformer`` a model name in lm-eval's registry (idempotent): what lm-eval's
    ``lm_eval.models`` entry point (pyproject) does for releases that read entry points."""
    from lm_eval.api.registry import model_registry

    if NAME not in model_registry:
        model_registry.register(NAME, target=TorchformerLM)
