"""flowrec: declarative, inspectable, fast training of wide-and-deep / DLRM-style recommenders."""

__version__ = "0.1.0"
