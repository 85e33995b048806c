"""Evaluation: strided perplexity and bits per byte, seq2seq accuracy, sentence embeddings."""

from .embed import POOLINGS, embed, folder_settings
from .perplexity import Score, seq2seq_accuracy, strided_nll, text_perplexity, windows

__all__ = [
    "POOLINGS",
    "Score",
    "embed",
    "folder_settings",
    "seq2seq_accuracy",
    "strided_nll",
    "text_perplexity",
    "windows",
]
