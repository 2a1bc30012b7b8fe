"""The package version (pyproject.toml says the same; a test checks)."""

__version__ = "0.2.0"
