"""openpi's policy protocol for pi0.5: which observation keys mean what, and the metadata frame.

A client of openpi's websocket server (``openpi_client.WebsocketClientPolicy``) sends one
observation dict per call, its arrays as msgpack-numpy, with no batch dimension. Three layouts are
understood, recognised by their keys:

- ``droid``: ``observation/exterior_image_1_left`` (base camera), ``observation/wrist_image_left``
  (left wrist), state = ``observation/joint_position`` + ``observation/gripper_position``;
- ``libero``: ``observation/image`` (base), ``observation/wrist_image`` (left wrist),
  ``observation/state``;
- ``pi05``: the model's own names: ``image`` (a dict of camera slot -> image), ``state``.

Every layout also takes ``prompt`` (str) or ``token_ids`` (the whole prompt's ids), and optionally
``noise`` (the flow's start, ``[horizon, action_dim]``), ``seed`` and ``action_dim``. Images are uint8 (or [0, 1] float) ``[H, W, 3]``; the state is
unnormalised (the checkpoint's statistics normalise it; actions come back un-normalised).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mstar.models.pi05 import inputs as pi
from mstar.models.pi05.inputs import Observation

if TYPE_CHECKING:
    from mstar.models.pi05.adapter import Pi05Adapter

COMMON_KEYS = ("prompt", "token_ids", "noise", "seed", "action_dim")


@dataclass(frozen=True)
class ObservationLayout:
    """One robot's observation keys: camera key -> model camera slot, and the state's parts in order."""

    name: str
    cameras: Mapping[str, str]
    state: tuple[str, ...]
    marker: str  # the key whose presence selects this layout

    def keys(self) -> list[str]:
        return [*self.cameras, *self.state, *COMMON_KEYS]


LAYOUTS = (
    ObservationLayout("droid", {"observation/exterior_image_1_left": "base_0_rgb",
                                "observation/wrist_image_left": "left_wrist_0_rgb"},
                      ("observation/joint_position", "observation/gripper_position"),
                      marker="observation/exterior_image_1_left"),
    ObservationLayout("libero", {"observation/image": "base_0_rgb", "observation/wrist_image": "left_wrist_0_rgb"},
                      ("observation/state",), marker="observation/image"),
    ObservationLayout("pi05", {}, ("state",), marker="image"),
)


def layout_of(obs: Mapping[str, Any]) -> ObservationLayout:
    for layout in LAYOUTS:
        if layout.marker in obs:
            return layout
    raise ValueError("observation: no camera image; expected one of the layouts "
                     + "; ".join(f"{lay.name}: {lay.keys()}" for lay in LAYOUTS))


def observation_from_wire(obs: Mapping[str, Any]) -> Observation:
    """A decoded observation (numpy arrays, strings, numbers) -> ``Observation``."""
    if not isinstance(obs, Mapping):
        raise ValueError(f"observation must be a map, got {type(obs).__name__}")
    layout = layout_of(obs)
    unknown = sorted(k for k in obs if k not in layout.keys() and k != layout.marker)
    if unknown:
        raise ValueError(f"observation: unknown key(s) {unknown}; layout {layout.name!r} has {layout.keys()}")
    return Observation(cameras=_cameras(obs, layout), state=_state(obs, layout), prompt=obs.get("prompt"),
                       token_ids=_optional_array(obs, "token_ids"), noise=_optional_array(obs, "noise"),
                       seed=_scalar(obs.get("seed")),
                       action_dim=_scalar(obs.get("action_dim")))


def _cameras(obs: Mapping[str, Any], layout: ObservationLayout) -> dict[str, torch.Tensor]:
    if not layout.cameras:  # the model's names: a nested map
        images = obs["image"]
        if not isinstance(images, Mapping):
            raise ValueError("observation['image'] must map camera slots to images")
        return {str(k): _tensor(v, f"image {k!r}") for k, v in images.items()}
    return {slot: _tensor(obs[key], key) for key, slot in layout.cameras.items() if key in obs}


def _state(obs: Mapping[str, Any], layout: ObservationLayout) -> np.ndarray | None:
    parts = [k for k in layout.state if k in obs]
    if not parts:
        return None
    if len(parts) != len(layout.state):
        raise ValueError(f"observation: the state needs every one of {list(layout.state)}, got {parts}")
    return np.concatenate([pi.check_state(np.atleast_1d(np.asarray(obs[k])), k) for k in parts])


def _tensor(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, np.ndarray):
        raise ValueError(f"{what}: expected an array, got {type(value).__name__}")
    if value.dtype.kind not in "uif" or value.dtype.itemsize > 8:
        raise ValueError(f"{what}: unsupported dtype {value.dtype}")
    return torch.from_numpy(np.array(value, copy=True))


def _optional_array(obs: Mapping[str, Any], key: str) -> torch.Tensor | None:
    value = obs.get(key)
    if value is None:
        return None
    if isinstance(value, list):
        value = np.asarray(value)
    return _tensor(value, key)


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def metadata(adapter: Pi05Adapter) -> dict[str, Any]:
    """The first frame of every connection."""
    cfg = adapter.config
    return {
        "model": adapter.model_name,
        "action_horizon": cfg.horizon,
        "action_dim": cfg.action_dim,
        "image_size": [cfg.vision.image_size, cfg.vision.image_size],
        "cameras": list(pi.CAMERA_SLOTS[:cfg.max_cameras]),
        "layouts": {lay.name: lay.keys() for lay in LAYOUTS},
        "tokenizer": adapter.tokenizer is not None,
        "norm_stats": {"state": adapter.stats.state is not None, "actions": adapter.stats.actions is not None},
    }
