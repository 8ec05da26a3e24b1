"""Routing rules; each returns a :class:`sparseffn.routing.Routing`."""

from .sigma import SigmaRouter

__all__ = ["SigmaRouter"]
