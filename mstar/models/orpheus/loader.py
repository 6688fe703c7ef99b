"""Build the SNAC audio codec (``snac.SNAC``) of Orpheus TTS from a local checkpoint directory.

Layout (the one the Hugging Face repositories of SNAC use, e.g. ``hubertsiuzdak/snac_24khz``)::

    <dir>/config.json        the keyword arguments of ``snac.SNAC(...)``
    <dir>/pytorch_model.bin  the model's state dict (``torch.save(model.state_dict())``)

This is what ``snac.SNAC.from_pretrained`` reads for a local directory, but nothing here ever
contacts a model hub: a missing directory or file is an error. Differences from ``from_pretrained``:

* the state dict is read with ``torch.load(weights_only=True)`` (no arbitrary unpickling);
* unknown config keys and state-dict mismatches (missing, unexpected or mis-shaped tensors) raise
  :class:`SnacCheckpointError` naming the file. Checkpoints saved with the old
  ``torch.nn.utils.weight_norm`` names (``weight_g`` / ``weight_v``) load as well: torch's
  parametrized weight norm, which ``snac`` uses, converts them on load;
* ``noise`` can override the config's ``noise``. SNAC's decoder blocks then contain a
  ``NoiseBlock`` that adds ``randn`` noise (scaled by a learned projection) on every decode, so
  two decodes of the same codes differ. ``noise=False`` removes these blocks after loading (their
  weights are still checked against the checkpoint), making decoding deterministic; ``noise=True``
  needs a checkpoint that was trained with noise.

Audio length: SNAC's decoder upsamples its latent sequence by exactly ``prod(decoder_rates)``
(every transposed convolution maps length L to L*stride), and the latent sequence has
``vq_strides[0]`` steps per coarsest code, i.e. per Orpheus frame of 7 tokens. So one frame
decodes to ``vq_strides[0] * prod(decoder_rates)`` samples (:func:`samples_per_frame`):
4 * (8*8*4*2) = 2048 samples (85.3 ms at 24 kHz) for the real 24 kHz model, 16 for
:data:`TINY_SNAC_CONFIG`.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import snac
import torch
from snac.layers import NoiseBlock

__all__ = [
    "CONFIG_FILE",
    "SNAC_24KHZ_CONFIG",
    "TINY_SNAC_CONFIG",
    "WEIGHTS_FILE",
    "SnacCheckpointError",
    "build_snac",
    "dummy_snac",
    "load_snac",
    "remove_noise",
    "samples_per_frame",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "pytorch_model.bin"

# config.json of the 24 kHz SNAC that Orpheus uses (for reference and shape checks; no weights)
SNAC_24KHZ_CONFIG: dict[str, Any] = {
    "sampling_rate": 24000,
    "encoder_dim": 48,
    "encoder_rates": [2, 4, 8, 8],
    "decoder_dim": 1024,
    "decoder_rates": [8, 8, 4, 2],
    "attn_window_size": None,
    "codebook_size": 4096,
    "codebook_dim": 8,
    "vq_strides": [4, 2, 1],
    "noise": True,
    "depthwise": True,
}

# A few-ten-thousand-parameter SNAC for tests (decodes in milliseconds on a CPU). Keeps the real
# codebook size (Orpheus codes are in [0, 4096)) and vq_strides [4, 2, 1] (the 1:2:4 code layout of
# an Orpheus frame); 16 samples per frame.
TINY_SNAC_CONFIG: dict[str, Any] = {
    "sampling_rate": 24000,
    "encoder_dim": 8,
    "encoder_rates": [2, 2],
    "decoder_dim": 32,
    "decoder_rates": [2, 2],
    "attn_window_size": None,
    "codebook_size": 4096,
    "codebook_dim": 4,
    "vq_strides": [4, 2, 1],
    "noise": False,
    "depthwise": True,
}

_SNAC_PARAMS = {n: p for n, p in inspect.signature(snac.SNAC.__init__).parameters.items() if n != "self"}
_SNAC_ARGS = frozenset(_SNAC_PARAMS)


class SnacCheckpointError(ValueError):
    """The SNAC checkpoint directory is malformed or does not fit its config."""


def samples_per_frame(model: snac.SNAC) -> int:
    """Audio samples decoded per Orpheus frame (7 tokens = one coarsest-level code)."""
    return int(model.vq_strides[0]) * math.prod(int(r) for r in model.decoder_rates)


def build_snac(config: Mapping[str, Any], source: str = "config") -> snac.SNAC:
    """``snac.SNAC(**config)`` with unknown keys reported (``source`` names the config in errors)."""
    unknown = sorted(set(config) - _SNAC_ARGS)
    if unknown:
        raise SnacCheckpointError(f"{source}: unknown SNAC config keys {unknown}; expected a subset of "
                                  f"{sorted(_SNAC_ARGS)}")
    strides = list(config.get("vq_strides", _SNAC_PARAMS["vq_strides"].default))
    if len(strides) != 3:
        raise SnacCheckpointError(f"{source}: Orpheus needs a 3-level SNAC (vq_strides like [4, 2, 1]), "
                                  f"got vq_strides={strides}")
    return snac.SNAC(**config)


def remove_noise(model: snac.SNAC) -> snac.SNAC:
    """Replace every ``NoiseBlock`` of ``model`` by an identity (in place): deterministic decoding."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, NoiseBlock):
                setattr(parent, name, torch.nn.Identity())
    return model


def _has_noise(model: snac.SNAC) -> bool:
    return any(isinstance(m, NoiseBlock) for m in model.modules())


def _apply_noise(model: snac.SNAC, noise: bool | None, source: str) -> snac.SNAC:
    if noise is None or noise == _has_noise(model):
        return model
    if noise:
        raise SnacCheckpointError(f"{source}: noise=True requested but the model was built without noise "
                                  f"blocks (config noise=false): there are no weights for them")
    return remove_noise(model)


def load_snac(path: str | Path, dtype: torch.dtype = torch.float32, noise: bool | None = None) -> snac.SNAC:
    """Load a SNAC codec from a local directory holding ``config.json`` + ``pytorch_model.bin``.

    ``noise``: None keeps the config's setting; False removes the decoder's noise blocks
    (deterministic decoding); True requires a config with ``noise: true``. Returns the model in
    eval mode, on the CPU, in ``dtype``.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"SNAC checkpoint directory {str(root)!r} does not exist (models are only "
                                f"read from local directories: download {CONFIG_FILE} and {WEIGHTS_FILE} first)")
    config_path, weights_path = root / CONFIG_FILE, root / WEIGHTS_FILE
    for f in (config_path, weights_path):
        if not f.is_file():
            raise FileNotFoundError(f"SNAC checkpoint {str(root)!r} has no {f.name} (expected {CONFIG_FILE} "
                                    f"with the SNAC constructor arguments and {WEIGHTS_FILE} with its state dict)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise SnacCheckpointError(f"{config_path}: cannot read JSON ({e})") from e
    if not isinstance(config, dict):
        raise SnacCheckpointError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    model = build_snac(config, source=str(config_path))
    try:
        state = torch.load(weights_path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad checkpoint
        raise SnacCheckpointError(f"{weights_path}: cannot load the state dict ({type(e).__name__}: {e})") from e
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise SnacCheckpointError(f"{weights_path}: expected a state dict (names -> tensors)")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise SnacCheckpointError(f"{weights_path} does not match {config_path.name}: {e}") from e
    model = _apply_noise(model, noise, str(config_path))
    return model.to(dtype=dtype).eval()


def dummy_snac(seed: int = 0, config: Mapping[str, Any] | None = None,
               dtype: torch.dtype = torch.float32, noise: bool | None = None) -> snac.SNAC:
    """A randomly initialised SNAC (default :data:`TINY_SNAC_CONFIG`), the same for the same seed.

    Uses its own RNG state: the global torch RNG is left untouched.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_snac(dict(TINY_SNAC_CONFIG if config is None else config))
    model = _apply_noise(model, noise, "dummy_snac")
    return model.to(dtype=dtype).eval()
