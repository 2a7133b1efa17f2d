"""The model families the engine serves (one file each) and their registry by HF ``model_type``."""

from .family import Family, UnsupportedModelError
from .registry import FAMILIES, family_of, read_config

__all__ = ["FAMILIES", "Family", "UnsupportedModelError", "family_of", "read_config"]
