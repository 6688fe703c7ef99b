"""A planner's workload: what arrives, how often, how large; read from YAML with errors that name the field.

::

    arrival_rate: 4.0          # requests per second, Poisson arrivals
    duration_s: 60             # how long the workload runs (default 60)
    seed: 0                    # the arrivals' and lengths' draws (default 0)
    requests:                  # the mix: each class drawn with probability weight / sum of weights
      - name: chat
        weight: 3
        prompt_tokens: {uniform: [32, 256]}   # or a fixed int, or {choice: [32, 64, 128]}
        output_tokens: 128
        params: {}             # the model's request params, as Runtime.submit takes them
      - name: image
        weight: 1
        walk: image_gen_cfg    # optional: the walk this class starts with, where the model has several
        output_tokens: 0

``load_workload(path)`` / ``parse_workload(mapping)`` return a ``Workload``; a bad file raises
``WorkloadError`` whose message starts with the field's path (``requests[1].prompt_tokens``).
``Workload.arrivals()`` draws the requests (seeded): the same list for the simulator and for a real
run against the runtime.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Arrival", "LengthDist", "RequestClass", "Workload", "WorkloadError", "load_workload", "parse_workload"]


class WorkloadError(ValueError):
    """A workload file that cannot be used; the message names the field."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}" if path else problem)
        self.field = path


@dataclass(frozen=True)
class LengthDist:
    """Token counts: ``fixed``, ``uniform`` over ``[low, high]`` (inclusive), or a ``choice`` among values."""

    kind: str  # "fixed", "uniform" or "choice"
    values: tuple[int, ...]  # fixed: (n,); uniform: (low, high); choice: the values

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.values[0]
        if self.kind == "uniform":
            return rng.randint(self.values[0], self.values[1])
        return rng.choice(self.values)

    @property
    def mean(self) -> float:
        if self.kind == "uniform":
            return (self.values[0] + self.values[1]) / 2
        return sum(self.values) / len(self.values)

    @property
    def largest(self) -> int:
        return max(self.values)


@dataclass(frozen=True)
class RequestClass:
    name: str
    weight: float
    prompt_tokens: LengthDist
    output_tokens: LengthDist
    walk: str | None = None  # the walk it starts with, where the model has several
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Arrival:
    """One drawn request: when it arrives (seconds from the start), its class and its sizes."""

    at_s: float
    request_class: str
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Workload:
    arrival_rate: float  # requests per second
    requests: tuple[RequestClass, ...]
    duration_s: float = 60.0
    seed: int = 0

    def classes(self) -> dict[str, RequestClass]:
        return {c.name: c for c in self.requests}

    def arrivals(self, duration_s: float | None = None) -> list[Arrival]:
        """Poisson arrivals at ``arrival_rate`` over ``duration_s`` (default the workload's), each of a
        class drawn by weight and with its lengths drawn; the same list for the same seed."""
        rng = random.Random(self.seed)
        total = sum(c.weight for c in self.requests)
        span = self.duration_s if duration_s is None else duration_s
        out, t = [], 0.0
        while True:
            t += rng.expovariate(self.arrival_rate)
            if t >= span:
                return out
            pick, acc = rng.random() * total, 0.0
            chosen = self.requests[-1]
            for c in self.requests:
                acc += c.weight
                if pick < acc:
                    chosen = c
                    break
            out.append(Arrival(t, chosen.name, chosen.prompt_tokens.draw(rng), chosen.output_tokens.draw(rng)))


# -- parsing -----------------------------------------------------------------------------------------------
_TOP = ("arrival_rate", "duration_s", "seed", "requests")
_CLASS = ("name", "weight", "prompt_tokens", "output_tokens", "walk", "params")


def _number(value: Any, path: str, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise WorkloadError(path, f"must be a number, got {value!r}")
    if positive and value <= 0:
        raise WorkloadError(path, f"must be > 0, got {value!r}")
    return float(value)


def _count(value: Any, path: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkloadError(path, f"must be an integer, got {value!r}")
    if value < minimum:
        raise WorkloadError(path, f"must be >= {minimum}, got {value}")
    return value


def _unknown(got: Mapping[str, Any], known: tuple[str, ...], path: str) -> None:
    extra = sorted(set(got) - set(known))
    if extra:
        where = f"{path}.{extra[0]}" if path else extra[0]
        raise WorkloadError(where, f"unknown field (known: {', '.join(known)})")


def _length(value: Any, path: str, minimum: int) -> LengthDist:
    if not isinstance(value, Mapping):
        return LengthDist("fixed", (_count(value, path, minimum=minimum),))
    if len(value) != 1 or next(iter(value)) not in ("uniform", "choice"):
        raise WorkloadError(path, "must be an integer, {uniform: [low, high]} or {choice: [values]}")
    kind, items = next(iter(value.items()))
    if not isinstance(items, list | tuple) or not items:
        raise WorkloadError(f"{path}.{kind}", f"must be a non-empty list, got {items!r}")
    values = tuple(_count(v, f"{path}.{kind}[{i}]", minimum=minimum) for i, v in enumerate(items))
    if kind == "uniform":
        if len(values) != 2:
            raise WorkloadError(f"{path}.uniform", f"must be [low, high], got {list(values)}")
        if values[0] > values[1]:
            raise WorkloadError(f"{path}.uniform", f"low {values[0]} is above high {values[1]}")
    return LengthDist(kind, values)


def _request_class(raw: Any, path: str) -> RequestClass:
    if not isinstance(raw, Mapping):
        raise WorkloadError(path, f"must be a mapping, got {type(raw).__name__}")
    _unknown(raw, _CLASS, path)
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise WorkloadError(f"{path}.name", "required: a non-empty string")
    walk = raw.get("walk")
    if walk is not None and (not isinstance(walk, str) or not walk):
        raise WorkloadError(f"{path}.walk", f"must be a walk's name, got {walk!r}")
    params = raw.get("params", {})
    if not isinstance(params, Mapping):
        raise WorkloadError(f"{path}.params", f"must be a mapping, got {type(params).__name__}")
    if "output_tokens" not in raw:
        raise WorkloadError(f"{path}.output_tokens", "required")
    return RequestClass(
        name=name, weight=_number(raw.get("weight", 1), f"{path}.weight"),
        prompt_tokens=_length(raw.get("prompt_tokens", 1), f"{path}.prompt_tokens", minimum=1),
        output_tokens=_length(raw["output_tokens"], f"{path}.output_tokens", minimum=0),
        walk=walk, params=dict(params))


def parse_workload(raw: Any) -> Workload:
    """A ``Workload`` from a YAML document's contents (see the module doc)."""
    if not isinstance(raw, Mapping):
        raise WorkloadError("", f"a workload is a mapping with {', '.join(_TOP)}; got {type(raw).__name__}")
    _unknown(raw, _TOP, "")
    if "arrival_rate" not in raw:
        raise WorkloadError("arrival_rate", "required (requests per second)")
    requests = raw.get("requests")
    if not isinstance(requests, list) or not requests:
        raise WorkloadError("requests", "required: a non-empty list of request classes")
    classes = tuple(_request_class(r, f"requests[{i}]") for i, r in enumerate(requests))
    seen: set[str] = set()
    for i, c in enumerate(classes):
        if c.name in seen:
            raise WorkloadError(f"requests[{i}].name", f"{c.name!r} is used twice")
        seen.add(c.name)
    seed = raw.get("seed", 0)
    return Workload(arrival_rate=_number(raw["arrival_rate"], "arrival_rate"), requests=classes,
                    duration_s=_number(raw.get("duration_s", 60), "duration_s"),
                    seed=_count(seed, "seed", minimum=0))


def load_workload(path: str | Path) -> Workload:
    """``parse_workload`` of a YAML file; a missing or unparsable file is a ``WorkloadError`` too."""
    import yaml

    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise WorkloadError("", f"cannot read workload file {str(p)!r}: {e.strerror or e}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise WorkloadError("", f"{p.name} is not valid YAML: {e}") from None
    return parse_workload(raw)
