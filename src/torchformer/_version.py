"""The one place the version is written; pyproject.toml reads it (dynamic version)."""

__version__ = "0.1.0"
