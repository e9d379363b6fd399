"""The `streamfleet` command and the all-in-one launcher."""

__version__ = "0.1.0"
