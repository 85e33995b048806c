"""Optional dependencies, each named for the extra that installs it.

The core install is torch, safetensors and numpy; everything else comes from an extra. A missing
one raises ``MissingExtra`` (an ImportError) whose message says which extra to install, instead of
a bare ``No module named 'yaml'`` from deep inside a command.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# module -> (extra, what needs it)
PROVIDERS: dict[str, tuple[str, str]] = {
    "yaml": ("train", "reading training recipes"),
    "tqdm": ("train", "the training progress bar"),
    "tokenizers": ("train", "tokenizers (training data, a checkpoint's tokenizer.json)"),
    "matplotlib": ("viz", "figures (loss curves, attention maps)"),
    "gguf": ("gguf", "reading and writing GGUF files (llama.cpp, Ollama)"),
    "lm_eval": ("eval", "lm-evaluation-harness tasks (torchformer eval --tasks, lm_eval --model torchformer)"),
}


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def require(module: str, extra: str | None = None) -> ModuleType:
    """Import ``module`` (a top-level name from PROVIDERS, or a dotted submodule of one); ``extra``
    overrides the extra named in the message where another one is the natural install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        top = module.split(".", 1)[0]
        if err.name is None or err.name.split(".", 1)[0] != top or top not in PROVIDERS:
            raise
        default_extra, purpose = PROVIDERS[top]
        extra = extra or default_extra
        raise MissingExtra(
            f"{purpose} needs the `{top}` package, which is not installed: pip install 'torchformer[{extra}]'"
        ) from err
