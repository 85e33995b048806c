"""GGUF (llama.cpp's and Ollama's file format) both ways, over the same family tables as the
Hugging Face interop: container.py (open and check), archs.py (architectures as data: metadata ->
config.json, the converter's tensor changes), weights.py (types -> tensors and quantized modules),
read.py (from_gguf), tokenizer.py (tokenizer.ggml.* -> tokenizers.Tokenizer), write.py (to_gguf) and
vocab.py (tokenizers.Tokenizer -> tokenizer.ggml.*).
"""

from .read import config_from_gguf, from_gguf
from .write import to_gguf

__all__ = ["config_from_gguf", "from_gguf", "to_gguf"]
