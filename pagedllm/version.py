"""The package version (its own module, so every room can read it without importing the package face)."""
__version__ = "0.1.0"
