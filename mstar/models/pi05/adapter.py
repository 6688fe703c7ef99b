"""How pi0.5 meets the API: an observation (camera images, state, prompt or token ids, noise seed)
-> a ``Pi05Request`` for the runtime, and the emitted ``actions`` chunk -> the robot's actions
(un-normalised with the checkpoint's statistics, sliced to the robot's action dimension).

``/generate`` takes either the model's own inputs (``images``, ``image_masks``, ``token_ids``, ...:
``Pi05Request``'s names, answered with the raw chunk) or an observation: one uint8 (or [0, 1]
float) ``[H, W, 3]`` tensor per camera slot, ``state``, ``token_ids`` and, in ``params``,
``prompt``, ``seed`` and ``action_dim``. The websocket policy route speaks openpi's protocol
(``policy_server.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from mstar.model.adapter import GENERATE, POLICY, ApiAdapter, ApiRequest
from mstar.models.pi05 import inputs as pi
from mstar.models.pi05.config import Pi05Config, Pi05Request
from mstar.models.pi05.inputs import Observation

OBSERVATION_INPUTS = frozenset({*pi.CAMERA_SLOTS, "state", "token_ids", "noise"})
MODEL_INPUTS = frozenset({"images", "image_masks", "token_ids", "token_mask", "noise"})
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class ActionOutput:
    """What the chunk needs before it leaves: un-normalising (when the checkpoint has action
    statistics) and the dimensions the robot uses (None: all of them)."""

    unnormalize: bool = False
    action_dim: int | None = None


@dataclass(frozen=True)
class PolicyRequest(ApiRequest):
    output: ActionOutput = field(default_factory=ActionOutput)
    state: np.ndarray | None = None  # echoed in the policy reply


class PolicyModel(Protocol):
    """What the adapter reads of its model: sizes, name and checkpoint directory (None: no files)."""

    name: str
    config: Pi05Config
    model_path: str | None


class Pi05Adapter(ApiAdapter):
    """The SentencePiece tokenizer and the normalisation statistics are looked for in the model's
    checkpoint directory (a tiny model has none); ``stats`` / ``tokenizer`` override them."""

    routes = frozenset({GENERATE, POLICY})

    def __init__(self, model: PolicyModel, stats: pi.NormStats | None = None,
                 tokenizer: pi.PromptTokenizer | None = None) -> None:
        self.config: Pi05Config = model.config
        self.model_name = model.name
        self.stats = stats if stats is not None else pi.load_norm_stats(model.model_path)
        self.tokenizer = tokenizer if tokenizer is not None else pi.PromptTokenizer.find(model.model_path)

    # -- observation -> request ----------------------------------------------------------------------

    def request(self, obs: Observation) -> PolicyRequest:
        size = self.config.vision.image_size
        cams = pi.prepare_cameras(obs.cameras, size, size, pi.CAMERA_SLOTS[:self.config.max_cameras])
        state = None if obs.state is None else pi.check_state(obs.state)
        tokens = self._tokens(obs, state)
        seed = _seed(obs.seed)
        req = Pi05Request(images=cams.images, image_masks=cams.mask, token_ids=tokens.ids, token_mask=tokens.mask,
                          noise=self._noise(obs.noise), seed=seed)
        inputs, params = req.to_runtime()
        output = ActionOutput(self.stats.actions is not None, self._action_dim(obs.action_dim))
        return PolicyRequest(inputs, params, prompt_tokens=int(tokens.ids.numel()), output=output, state=state)

    def _tokens(self, obs: Observation, state: np.ndarray | None) -> pi.PromptTokens:
        """Token ids given directly are the whole prompt (the state already in it); a prompt is
        built with the state and encoded with the checkpoint's tokenizer."""
        limit = self.config.max_text_tokens
        if obs.token_ids is not None and obs.prompt is not None:
            raise ValueError("give a prompt or token_ids, not both")
        if obs.token_ids is not None:
            return pi.prompt_tokens(obs.token_ids, self.config.vocab_size, limit)
        if obs.prompt is None:
            raise ValueError("give a prompt (with a state) or token_ids")
        if not isinstance(obs.prompt, str):
            raise ValueError(f"prompt must be a string, got {type(obs.prompt).__name__}")
        if state is None:
            raise ValueError("pi0.5 needs the robot state with a prompt (it is discretised into the prompt text)")
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no SentencePiece tokenizer (paligemma_tokenizer.model): "
                             "send token_ids instead of a prompt")
        text = pi.state_prompt(obs.prompt, pi.normalized_state(state, self.stats))
        return pi.prompt_tokens(self.tokenizer.encode(text), self.config.vocab_size, limit)

    def _noise(self, noise: torch.Tensor | None) -> torch.Tensor | None:
        if noise is None:
            return None
        shape = (self.config.horizon, self.config.action_dim)
        if tuple(noise.shape) != shape or not noise.is_floating_point() or not bool(torch.isfinite(noise).all()):
            raise ValueError(f"noise must be finite floats of shape {list(shape)}, got {list(noise.shape)} "
                             f"{noise.dtype}")
        return noise.to(torch.float32)

    def _action_dim(self, wanted: int | None) -> int | None:
        if wanted is None:
            return None if self.stats.actions is None else min(self.stats.actions.q01.size, self.config.action_dim)
        if isinstance(wanted, bool) or not isinstance(wanted, (int, np.integer)) \
                or not 1 <= wanted <= self.config.action_dim:
            raise ValueError(f"action_dim must be an integer in [1, {self.config.action_dim}], got {wanted!r}")
        return int(wanted)

    # -- chunk -> robot actions ------------------------------------------------------------------------

    def actions(self, output: ActionOutput, chunk: torch.Tensor) -> np.ndarray:
        """The model's ``[horizon, action_dim]`` chunk -> float32 ``[horizon, robot dims]``."""
        a = chunk.detach().to(torch.float32).cpu().numpy()
        if output.unnormalize and self.stats.actions is not None:
            a = self.stats.actions.unnormalize(a)
        if output.action_dim is not None:
            a = a[..., :output.action_dim]
        return np.ascontiguousarray(a, dtype=np.float32)

    # -- /generate -----------------------------------------------------------------------------------

    def generate_request(self, inputs: dict[str, torch.Tensor], params: dict[str, Any]) -> ApiRequest:
        if "images" in inputs:  # the model's own inputs: validated by the model, answered raw
            unknown = sorted(set(inputs) - MODEL_INPUTS)
            if unknown:
                raise ValueError(f"unknown input(s) {unknown}; model inputs are {sorted(MODEL_INPUTS)}")
            return ApiRequest(dict(inputs), {k: v for k, v in params.items() if k == "seed"})
        unknown = sorted(set(inputs) - OBSERVATION_INPUTS)
        if unknown:
            raise ValueError(f"unknown input(s) {unknown}; an observation has {sorted(OBSERVATION_INPUTS)} "
                             f"(or the model inputs {sorted(MODEL_INPUTS)})")
        cams = {k: v for k, v in inputs.items() if k in pi.CAMERA_SLOTS}
        state = inputs.get("state")
        obs = Observation(cameras=cams, state=None if state is None else state.numpy(), prompt=params.get("prompt"),
                          token_ids=inputs.get("token_ids"), noise=inputs.get("noise"), seed=params.get("seed"),
                          action_dim=params.get("action_dim"))
        return self.request(obs)

    def generate_outputs(self, request: ApiRequest, name: str, value: list[torch.Tensor]) -> list[torch.Tensor]:
        if name != "actions" or not isinstance(request, PolicyRequest):
            return value
        return [torch.from_numpy(self.actions(request.output, value[0]))]

    # -- the websocket policy route -------------------------------------------------------------------

    def policy_metadata(self) -> dict[str, Any]:
        from mstar.models.pi05.policy_server import metadata

        return metadata(self)

    def policy_request(self, observation: Mapping[str, Any]) -> ApiRequest:
        from mstar.models.pi05.policy_server import observation_from_wire

        return self.request(observation_from_wire(observation))

    def policy_reply(self, request: ApiRequest, outputs: Mapping[str, list[torch.Tensor]]) -> dict[str, Any]:
        if "actions" not in outputs or not isinstance(request, PolicyRequest):
            raise RuntimeError("the model emitted no actions")
        reply: dict[str, Any] = {"actions": self.actions(request.output, outputs["actions"][0])}
        if request.state is not None:
            reply["state"] = request.state
        return reply


def _seed(seed: Any) -> int | None:
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) <= MAX_SEED:
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    return int(seed)
