"""Text conventions every room shares, below all of them: byte-level BPE's alphabet
(byte_level.py) and chat templates found in a model folder and rendered in jinja2's sandbox
(chat_template.py). Imports nothing of torchformer and no torch."""
