"""The V-JEPA 2 reference for tests: ``mstar.bench.vjepa2_reference`` (documented timm stand-in),
skipping the tests that need it when cc-vjepa2 is not installed."""

from __future__ import annotations

import types

import pytest

from mstar.bench.vjepa2_reference import INSTALL_HINT, import_reference

SKIP_REASON = INSTALL_HINT


def reference() -> types.SimpleNamespace:
    """``ns.VisionTransformerPredictorAC``, ``ns.VisionTransformer``, ``ns.modules`` (vjepa2.models.utils.modules)."""
    try:
        return import_reference()
    except ImportError:
        pytest.skip(SKIP_REASON)
