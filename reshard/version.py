"""reshard's version, in a module of its own so that modules the package imports can name it (manifest)."""
__version__ = "0.1.0"
