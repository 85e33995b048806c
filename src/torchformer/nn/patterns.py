"""Attention patterns, each defined once as a function of index tensors (b, h, q_idx, kv_idx).

A mask rule returns bool (True = query q_idx of row b may attend to key kv_idx), a bias rule the
float added to the scaled score of head h. Rules close over small per-forward tensors: per-row
query positions (B, T), key positions (B, S), key validity (B, S), document ids, ALiBi slopes,
T5's bucket table. The dense (B, 1, T, S) mask and (B, H, T, S) bias that ``math`` and ``sdpa``
take are the same rules evaluated on broadcast index grids (``dense_mask``, ``dense_bias``), and
flex's ``mask_mod`` / ``score_mod`` call them element by element inside the kernel: one
definition, so the dense and the in-kernel forms cannot drift.

Legend: B batch, H heads, T queries, S keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

Rule = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]  # (b, h, q_idx, kv_idx) -> bool | float


def causal(q_pos: Tensor, k_pos: Tensor) -> Rule:
    """Key j is visible to query i iff k_pos[j] <= q_pos[i]; (B, T), (B, S). With q_pos = the last
    T of S key positions this is the lower triangle aligned bottom-right (cached chunks)."""
    return lambda b, h, q, kv: k_pos[b, kv] <= q_pos[b, q]


def window(q_pos: Tensor, k_pos: Tensor, size: int) -> Rule:
    """Only the last ``size`` positions are visible (Mistral's sliding window)."""
    return lambda b, h, q, kv: (q_pos[b, q] - k_pos[b, kv]) < size


def key_valid(valid: Tensor) -> Rule:
    """Keys marked False in valid (B, S) are never visible (padding)."""
    return lambda b, h, q, kv: valid[b, kv]


def same_document(q_doc: Tensor, k_doc: Tensor) -> Rule:
    """Packed sequences: a query sees only keys of its own document; ids (B, T), (B, S)."""
    return lambda b, h, q, kv: q_doc[b, q] == k_doc[b, kv]


def all_of(rules: list[Rule | None]) -> Rule | None:
    """The logical AND of the rules that are present; None when none is."""
    present = [r for r in rules if r is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]

    def rule(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        out = present[0](b, h, q, kv)
        for r in present[1:]:
            out = out & r(b, h, q, kv)
        return out

    return rule


def grids(B: int, H: int, T: int, S: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Broadcastable index grids b (B,1,1,1), h (1,H,1,1), q (1,1,T,1), kv (1,1,1,S)."""
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    return b, h, torch.arange(T, device=device).view(1, 1, T, 1), torch.arange(S, device=device).view(1, 1, 1, S)


def dense_mask(rule: Rule, B: int, T: int, S: int, device: torch.device, *, key_only: bool = False) -> Tensor:
    """The rule on the (B, 1, T, S) grid; key_only rules (padding alone) give (B, 1, 1, S)."""
    b, h, q, kv = grids(B, 1, 1 if key_only else T, S, device)
    return rule(b, h, q, kv).expand(B, 1, q.shape[2], S)


def dense_bias(rule: Rule, B: int, H: int, T: int, S: int, device: torch.device) -> Tensor:
    """The rule on the (B, H, T, S) grid, in fp32."""
    return rule(*grids(B, H, T, S, device)).float().expand(B, H, T, S)


@dataclass(frozen=True)
class Pattern:
    """Who may attend to whom and the score bias for one forward, as rules plus their sizes.

    Built once per forward by the stack and shared by every layer; frozen: what a backend's
    prepare step adds (nn/routing.py) makes a new Pattern with ``dataclasses.replace``.
    ``blocks`` holds flex's block mask when the chosen path needs it (built once, not per layer);
    ``route`` is the backend that ``auto`` picked for this forward; ``params`` are the tensors a
    bias rule learns (T5's table), which flex's backward must return gradients for. ``aligned``:
    every row's queries and keys sit at the same positions (self-attention, no cache, padding or
    documents), so each rule is a function of (h, kv - q) only; ``reach``: a learned bias no
    longer varies with kv - q beyond +-reach (T5's max_distance). ``offsets`` holds that form
    when the chosen path uses it (nn/offsets.py). ``live``: in a cached step, the number of cache
    slots any query can see (a 0-d tensor, max position + 1); the slots beyond are masked for
    every query (``prefix_sdpa`` in nn/backends.py skips them).
    """

    mask: Rule | None
    bias: Rule | None
    B: int
    H: int
    T: int
    S: int
    device: torch.device
    key_only: bool = False
    params: tuple[Tensor, ...] = ()
    blocks: object | None = None
    aligned: bool = False
    reach: int | None = None
    offsets: object | None = None
    live: Tensor | None = None
    route: Callable[..., Tensor] | None = None
    # The dense forms, derived from the fields above on first use and kept for every layer of the
    # forward (set once through object.__setattr__, as a frozen class caches): a memo, not state;
    # a replaced Pattern starts without them.
    _dense: tuple[Tensor | None, Tensor | None] | None = field(default=None, init=False, repr=False, compare=False)
    _additive: Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def dense(self) -> tuple[Tensor | None, Tensor | None]:
        """(mask (B, 1, T|1, S) bool, bias (B, H, T, S) fp32), built once and kept."""
        if self._dense is None:
            mask = None if self.mask is None else dense_mask(self.mask, self.B, self.T, self.S, self.device,
                                                             key_only=self.key_only)  # fmt: skip
            bias = None if self.bias is None else dense_bias(self.bias, self.B, self.H, self.T, self.S, self.device)
            object.__setattr__(self, "_dense", (mask, bias))
        return self._dense

    def additive(self, dtype: torch.dtype) -> Tensor | None:
        """The dense mask and bias as one additive term (bias, -inf where masked) in ``dtype``, built
        once and kept: what SDPA takes in a cached step, converted once per forward, not per layer."""
        if self._additive is None or self._additive.dtype != dtype:
            mask, bias = self.dense()
            term = None if bias is None else bias.to(dtype)  # (B, H, T, S)
            if mask is not None:
                term = torch.zeros(mask.shape, dtype=dtype, device=mask.device) if term is None else term
                term = term.masked_fill(~mask, float("-inf"))  # (B, 1|H, T, S)
            object.__setattr__(self, "_additive", term)
        return self._additive


def from_dense(q: Tensor, k: Tensor, mask: Tensor | None, bias: Tensor | None, is_causal: bool) -> Pattern:
    """A Pattern for a direct backend call with dense arguments (checks and tests call backends
    that way): index the given tensors, or the bottom-right triangle for is_causal."""
    B, H, T, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    rules: list[Rule | None] = []
    if is_causal:
        rules.append(lambda b, h, qi, kv: kv <= qi + (S - T))
    if mask is not None:
        full = mask.expand(B, 1, T, S)
        rules.append(lambda b, h, qi, kv: full[b, 0, qi, kv])
    bias_rule = None
    if bias is not None:
        values = bias.float().expand(B, H, T, S)
        bias_rule = lambda b, h, qi, kv: values[b, h, qi, kv]  # noqa: E731
    return Pattern(all_of(rules), bias_rule, B, H, T, S, q.device)
