"""Prefix caching over the static cache's rows: a row keeps what it held after its request ends,
and a new request goes to the free row whose cached tokens share the longest prefix with its
prompt; only the rest of the prompt is prefilled (llama.cpp's server picks slots by prompt
similarity the same way; vLLM and SGLang share blocks instead, which a static cache cannot).

What a row holds is tracked exactly, because the cache is reused without clearing: the tokens
whose keys and values sit at slots 0..n-1, cut where something else was written since. An idle
row in an eager decode step writes a dummy key at the step's hidden slot (rows.py ``rows_view``:
slot ``length`` of a short view is a real slot), so that slot and everything after it are
forgotten; a failed prefill or step forgets the row. At least the prompt's last token is always
prefilled (its logits give the first new token), and a request that asks for its prompt's
logprobs (echo) is prefilled whole.
"""

from __future__ import annotations

# Fewer shared tokens are not worth leaving the batched prefill (rows.py) for a prefill of its own:
# a chat template's opening tokens are shared by every request.
MIN_REUSE = 16


def common(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Rows:
    """The tokens each row's cache holds at slots 0..len-1."""

    def __init__(self, slots: int) -> None:
        self.held: list[list[int]] = [[] for _ in range(slots)]

    def hold(self, row: int, tokens: list[int]) -> None:
        self.held[row] = list(tokens)

    def forget(self, row: int) -> None:
        self.held[row] = []

    def written(self, rows: list[int], slot: int) -> None:
        """Something else was written at ``slot`` of these rows: they hold only what came before."""
        for row in rows:
            del self.held[row][slot:]

    def best(self, free: list[int], prompt: list[int]) -> tuple[int | None, int]:
        """(row, reused tokens): the free row sharing the longest prefix with ``prompt``, at most
        all of it but its last token; (None, 0) when none shares MIN_REUSE tokens."""
        best_row, best_hit = None, MIN_REUSE - 1
        for row in free:
            hit = min(common(self.held[row], prompt), len(prompt) - 1)
            if hit > best_hit:
                best_row, best_hit = row, hit
        return (best_row, best_hit) if best_row is not None else (None, 0)
