"""Family adapters. Importing this package registers every built-in family."""

from . import gpt2, bert, llama, gemma3, phi3, gpt_neox, roberta  # noqa: F401, I001  (registration, in this order)
from .base import FAMILY_REGISTRY, FamilyAdapter, IdentityRotary, get_family, register_family

__all__ = ["FAMILY_REGISTRY", "FamilyAdapter", "IdentityRotary", "get_family", "register_family"]
