"""dflash-trainer: train DFlash block-diffusion drafters for speculative decoding."""

__version__ = "0.1.0"

# The built-in drafter variants register their settings with the config schema (torch-free), so that
# any use of the package, its config included, knows them: variants/__init__.py
from . import variants  # noqa: E402, F401
