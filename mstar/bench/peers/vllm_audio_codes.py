"""A vLLM (v1) logits processor for the Orpheus peer of ``mstar bench compare tts``; loaded by vLLM's
engine from the peer virtualenv (``--audio-constraint`` of ``vllm_llm.py``). mstar itself imports only
:func:`keep_audio_codes` (its tests check the mask; ``vllm`` is not installed there).

A request opts in with ``SamplingParams(extra_args={"audio_codes": {"base": B, "size": S, "frame": F,
"stop": T}})``: its ``i``-th generated token may then only be ``T`` or one of the ``S`` tokens from
``B + (i % F) * S`` -- the constraint mstar's Orpheus node and the HF baselines apply, so that a
model with random weights emits codes SNAC can decode. Other requests are left alone.
"""

from __future__ import annotations

import torch

try:
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates
except ImportError:  # outside the peer virtualenv: only keep_audio_codes is usable
    LogitsProcessor = object


def keep_audio_codes(logits: torch.Tensor, rows: torch.Tensor, lo: torch.Tensor, size: int,
                     stop: torch.Tensor) -> torch.Tensor:
    """In place: every column of ``logits[rows[j]]`` is -inf except ``lo[j] .. lo[j] + size - 1`` and
    ``stop[j]``, which keep their values; other rows are untouched."""
    cols = lo[:, None] + torch.arange(size, device=logits.device)  # [R, size]: the allowed audio tokens
    r = rows[:, None]
    kept, kept_stop = logits[r, cols], logits[r, stop[:, None]]
    logits.index_fill_(0, rows, float("-inf"))
    logits[r, cols] = kept
    logits[r, stop[:, None]] = kept_stop
    return logits


class AudioCodeConstraint(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        # batch row -> (base, size, frame, stop, the request's live list of generated tokens)
        self.rows: dict[int, tuple[int, int, int, int, list[int]]] = {}
        self.device = device

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        spec = (sampling_params.extra_args or {}).get("audio_codes")
        if spec is not None and not all(isinstance(spec.get(k), int) for k in ("base", "size", "frame", "stop")):
            raise ValueError("audio_codes needs integer base, size, frame and stop")

    def is_argmax_invariant(self) -> bool:
        return False

    @staticmethod
    def _state(params, _prompt: list[int] | None, output: list[int]):
        spec = (params.extra_args or {}).get("audio_codes")
        if spec is None:
            return None
        return spec["base"], spec["size"], spec["frame"], spec["stop"], output

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self._state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        dev = logits.device
        spec = list(self.rows.values())
        rows = torch.tensor(list(self.rows), device=dev)
        size = spec[0][1]
        if any(s != size for _, s, _, _, _ in spec):
            raise ValueError("audio_codes: every request of a batch needs the same code size")
        lo = torch.tensor([b + (len(out) % f) * s for b, s, f, _, out in spec], device=dev)
        stop = torch.tensor([t for _, _, _, t, _ in spec], device=dev)
        return keep_audio_codes(logits, rows, lo, size, stop)
