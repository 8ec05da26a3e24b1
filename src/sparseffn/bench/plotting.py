"""Matplotlib, loaded only when a plot is asked for (it is an optional dependency)."""

from __future__ import annotations


class MissingDependency(RuntimeError):
    """An optional package a command needs is not installed; the message says how to get it."""


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or MissingDependency."""
    try:
        import matplotlib
    except ImportError:
        raise MissingDependency("plots need matplotlib: pip install 'sparseffn[plot]' "
                                "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
