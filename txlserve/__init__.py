"""Shared by every txlserve package: the error hierarchy (:mod:`txlserve.errors`) and the version."""

from importlib import metadata


def version() -> str:
    """The installed distribution's, as ``pip show txlserve`` says it; "unknown" for a source tree on sys.path."""
    try:
        return metadata.version("txlserve")
    except metadata.PackageNotFoundError:
        return "unknown"
