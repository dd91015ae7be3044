"""The package version (its own module, so importing it runs nothing else)."""
__version__ = "0.1.0"
