"""Batches as a pure function of (seed, step): resuming at step s replays exactly the batches an
uninterrupted run would have seen, and every rank can compute the global batch and take its rows.

LM: random windows of seq_len + 1 tokens. MLM: windows with 15% of tokens selected, 80/10/10
(Devlin et al. 2019, 3.1). Seq2seq: pairs sorted by length and cut into batches of similar length
(less padding), served in a fresh random order each epoch. Labels use -100 for "no loss here".
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..nn.loss import IGNORE

Batch = dict[str, Tensor]


def generator(seed: int, step: int, stream: int) -> torch.Generator:
    """An RNG for one (seed, step, stream): independent of how many draws happened before."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 16 + stream)


def rows(batch: Batch, lo: int, hi: int) -> Batch:
    return {k: v[lo:hi] for k, v in batch.items()}


def n_targets(batch: Batch) -> int:
    """What the loss is a sum over: target tokens, or pairs for preference batches (their chosen rows)."""
    if "chosen" in batch:
        return int(batch["chosen"].sum())
    return int((batch["labels"] != IGNORE).sum())


def _windows(tokens: np.ndarray, starts: Tensor, length: int) -> Tensor:
    return torch.from_numpy(np.stack([tokens[s : s + length] for s in starts.tolist()]).astype(np.int64))


class LMBatches:
    """Causal LM: ids = window[:-1], labels = window[1:]."""

    def __init__(self, train: np.ndarray, val: np.ndarray, *, batch_size: int, seq_len: int, seed: int) -> None:
        need = batch_size * (seq_len + 1)
        if len(train) < need:
            raise ValueError(
                f"train.batch_size={batch_size} x (data.seq_len={seq_len} + 1) = {need} tokens is larger than the "
                f"training split ({len(train)} tokens): lower the batch size or seq_len, or add data"
            )
        if len(val) < seq_len + 1:
            raise ValueError(f"the validation split has {len(val)} tokens, fewer than data.seq_len + 1 = {seq_len + 1}")
        self.train, self.val, self.batch_size, self.seq_len, self.seed = train, val, batch_size, seq_len, seed

    def make(self, tokens: np.ndarray, starts: Tensor) -> Batch:
        w = _windows(tokens, starts, self.seq_len + 1)  # (B, T + 1)
        return {"ids": w[:, :-1], "labels": w[:, 1:]}

    def batch(self, step: int) -> Batch:
        high = len(self.train) - self.seq_len
        return self.make(
            self.train, torch.randint(0, high, (self.batch_size,), generator=generator(self.seed, step, 0))
        )

    def eval_batches(self, n: int) -> list[Batch]:
        # Fixed windows (not seed-dependent), so runs with different seeds report comparable losses.
        high = len(self.val) - self.seq_len
        g = generator(0, 0, 1)
        return [self.make(self.val, torch.randint(0, high, (self.batch_size,), generator=g)) for _ in range(n)]


def mlm_mask(ids: Tensor, g: torch.Generator, *, mask_id: int, ordinary: tuple[int, int], p: float = 0.15) -> Batch:
    """Select p of the ordinary tokens; of those 80% -> mask_id, 10% -> a random token, 10% kept."""
    lo, hi = ordinary
    eligible = (ids >= lo) & (ids < hi)
    chosen = (torch.rand(ids.shape, generator=g) < p) & eligible
    kind = torch.rand(ids.shape, generator=g)
    random_ids = torch.randint(lo, hi, ids.shape, generator=g)
    out = torch.where(chosen & (kind < 0.8), torch.full_like(ids, mask_id), ids)
    out = torch.where(chosen & (kind >= 0.8) & (kind < 0.9), random_ids, out)
    return {"ids": out, "labels": torch.where(chosen, ids, torch.full_like(ids, IGNORE))}


class MLMBatches(LMBatches):
    def __init__(self, train, val, *, batch_size, seq_len, seed, mask_id: int, ordinary: tuple[int, int], p: float):
        super().__init__(train, val, batch_size=batch_size, seq_len=seq_len, seed=seed)
        self.mask_id, self.ordinary, self.p = mask_id, ordinary, p

    def make(self, tokens: np.ndarray, starts: Tensor, g: torch.Generator | None = None) -> Batch:
        ids = _windows(tokens, starts, self.seq_len)  # (B, T)
        g = generator(self.seed, int(starts.sum()), 2) if g is None else g
        return mlm_mask(ids, g, mask_id=self.mask_id, ordinary=self.ordinary, p=self.p)

    def batch(self, step: int) -> Batch:
        high = len(self.train) - self.seq_len + 1
        starts = torch.randint(0, high, (self.batch_size,), generator=generator(self.seed, step, 0))
        return self.make(self.train, starts, generator(self.seed, step, 2))


class PairBatches:
    """Seq2seq teacher forcing: src + </s>; decoder input <s> + tgt; labels tgt + </s>."""

    def __init__(self, train, val, *, batch_size: int, seed: int, pad: int, bos: int, eos: int) -> None:
        if len(train) < batch_size:
            raise ValueError(
                f"train.batch_size={batch_size} is larger than the training split ({len(train)} pairs): "
                "lower the batch size or add data"
            )
        self.train, self.val, self.batch_size, self.seed = train, val, batch_size, seed
        self.pad, self.bos, self.eos = pad, bos, eos
        order = sorted(range(len(train)), key=lambda i: (len(train[i][0]) + len(train[i][1]), i))
        self.chunks = [order[i : i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]

    def collate(self, pairs) -> Batch:
        B = len(pairs)
        S = max(len(s) for s, _ in pairs) + 1
        T = max(len(t) for _, t in pairs) + 1
        # Filled in numpy row by row: per-row torch ops cost more than this tiny model's step.
        src = np.full((B, S), self.pad, dtype=np.int64)
        tgt = np.full((B, T), self.pad, dtype=np.int64)
        labels = np.full((B, T), IGNORE, dtype=np.int64)
        for i, (s, t) in enumerate(pairs):
            src[i, : len(s)], src[i, len(s)] = s, self.eos
            tgt[i, 0], tgt[i, 1 : len(t) + 1] = self.bos, t
            labels[i, : len(t)], labels[i, len(t)] = t, self.eos
        src_t = torch.from_numpy(src)
        return {"src": src_t, "src_mask": (src_t != self.pad).long(), "tgt": torch.from_numpy(tgt),
                "labels": torch.from_numpy(labels)}  # fmt: skip

    def batch(self, step: int) -> Batch:
        epoch, k = divmod(step, len(self.chunks))
        order = torch.randperm(len(self.chunks), generator=generator(self.seed, epoch, 3))
        return self.collate([self.train[i] for i in self.chunks[int(order[k])]])

    def eval_batches(self, n: int | None = None) -> list[Batch]:
        order = sorted(range(len(self.val)), key=lambda i: len(self.val[i][0]) + len(self.val[i][1]))
        chunks = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        return [self.collate([self.val[i] for i in c]) for c in chunks[:n]]


class PackedLMBatches(LMBatches):
    """data.pack: LM windows over the concatenated documents (each ends in EOS), with document
    ids (B, T) so attention stays inside each document and positions restart at each one. The
    label that would cross into the next document is ignored. Nothing is padding."""

    def __init__(self, train, val, train_docs: np.ndarray, val_docs: np.ndarray, *, batch_size, seq_len, seed):
        super().__init__(train, val, batch_size=batch_size, seq_len=seq_len, seed=seed)
        self.docs = {id(train): train_docs, id(val): val_docs}

    def make(self, tokens: np.ndarray, starts: Tensor) -> Batch:
        w = _windows(tokens, starts, self.seq_len + 1)  # (B, T + 1)
        index = starts[:, None].numpy() + np.arange(self.seq_len + 1)  # (B, T + 1) token offsets
        doc = np.searchsorted(self.docs[id(tokens)], index, side="right") - 1
        doc = torch.from_numpy(doc - doc[:, :1])  # (B, T + 1), 0 for each window's first document
        labels = w[:, 1:].masked_fill(doc[:, 1:] != doc[:, :-1], IGNORE)
        return {"ids": w[:, :-1], "labels": labels, "document_ids": doc[:, :-1]}
