"""The error every configuration check raises (loader, ranges, validate, planning)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user error in a recipe or an override; the message names the key and its source."""
