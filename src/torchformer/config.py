"""``torchformer.config``: the configs' import path before they became the ``configs`` package
(issue 28). Kept so that ``from torchformer.config import ModelConfig, RoPE`` goes on working;
the classes live in configs/ and this module holds the same objects, not copies."""

from .configs import *  # noqa: F403 (one list of names: configs/__init__.py's __all__)
from .configs import __all__  # noqa: F401
