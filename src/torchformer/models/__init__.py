"""The three model shapes, built from a ModelConfig by models/build.py."""
