"""flowrec's version, in a module of its own so that nothing needs to import the package face
(`flowrec/__init__.py`) to read it."""
__version__ = "0.1.0"
