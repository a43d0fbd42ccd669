"""The quern version, ``quern.__version__`` (the same as ``pyproject.toml``'s); below every other module."""

__all__ = ["__version__"]

__version__ = "0.1.0"
