"""flowrec: declarative, inspectable, fast training of wide-and-deep / DLRM-style recommenders."""

__version__ = "0.1.0"


def load_model(path):
    """Load a model package written by `flowrec export` for scoring raw rows.

    Example:
        >>> model = flowrec.load_model("pkg/ml")  # doctest: +SKIP
        >>> model.predict(raw_table)  # doctest: +SKIP  # one score column per head
    """
    from flowrec.runtime.predict import load_model as load

    return load(path)
