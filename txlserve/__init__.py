"""Shared by every txlserve package; today only the error hierarchy (:mod:`txlserve.errors`)."""
