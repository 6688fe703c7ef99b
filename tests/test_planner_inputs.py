"""The planner's inputs: workload files (errors name the field) and SLO strings, and the seeded arrivals."""

from __future__ import annotations

import statistics

import pytest

from mstar.planner import SLOError, WorkloadError, load_workload, parse_slo, parse_workload
from mstar.planner.slo import percentile

GOOD = """
arrival_rate: 5
duration_s: 200
seed: 3
requests:
  - name: chat
    weight: 3
    prompt_tokens: {uniform: [32, 256]}
    output_tokens: 128
  - name: image
    weight: 1
    walk: image_gen_cfg
    prompt_tokens: {choice: [16, 24]}
    output_tokens: 0
    params: {cfg_scale: 4.0}
"""


def test_a_good_file_and_its_arrivals(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text(GOOD)
    w = load_workload(path)
    assert w.arrival_rate == 5 and w.duration_s == 200 and w.seed == 3
    chat, image = w.requests
    assert (chat.weight, chat.prompt_tokens.kind, chat.prompt_tokens.values, chat.output_tokens.values) == \
        (3, "uniform", (32, 256), (128,))
    assert image.walk == "image_gen_cfg" and image.params == {"cfg_scale": 4.0} and image.prompt_tokens.mean == 20
    arrivals = w.arrivals()
    assert arrivals == w.arrivals()  # seeded
    assert all(0 < a.at_s < 200 for a in arrivals) and arrivals == sorted(arrivals, key=lambda a: a.at_s)
    assert 0.8 * 1000 < len(arrivals) < 1.2 * 1000  # 5 per second for 200 s
    share = sum(a.request_class == "chat" for a in arrivals) / len(arrivals)
    assert 0.68 < share < 0.82  # weight 3 of 4
    chats = [a.prompt_tokens for a in arrivals if a.request_class == "chat"]
    assert min(chats) >= 32 and max(chats) <= 256 and 120 < statistics.mean(chats) < 170
    assert {a.prompt_tokens for a in arrivals if a.request_class == "image"} == {16, 24}
    gaps = [b.at_s - a.at_s for a, b in zip(arrivals, arrivals[1:])]
    assert 0.16 < statistics.mean(gaps) < 0.24  # exponential gaps of mean 1 / 5 s


@pytest.mark.parametrize(("doc", "field", "why"), [
    ({"requests": [{"name": "a", "output_tokens": 1}]}, "arrival_rate", "required"),
    ({"arrival_rate": -1, "requests": [{"name": "a", "output_tokens": 1}]}, "arrival_rate", "must be > 0"),
    ({"arrival_rate": "fast", "requests": [{"name": "a", "output_tokens": 1}]}, "arrival_rate", "must be a number"),
    ({"arrival_rate": 1}, "requests", "non-empty list"),
    ({"arrival_rate": 1, "requests": [{"output_tokens": 1}]}, "requests[0].name", "required"),
    ({"arrival_rate": 1, "requests": [{"name": "a"}]}, "requests[0].output_tokens", "required"),
    ({"arrival_rate": 1, "requests": [{"name": "a", "output_tokens": 1, "prompt_tokens": {"uniform": [9, 3]}}]},
     "requests[0].prompt_tokens.uniform", "above high"),
    ({"arrival_rate": 1, "requests": [{"name": "a", "output_tokens": 1, "prompt_tokens": {"normal": 3}}]},
     "requests[0].prompt_tokens", "must be an integer"),
    ({"arrival_rate": 1, "requests": [{"name": "a", "output_tokens": 1, "prompt_tokens": {"choice": [4, 0]}}]},
     "requests[0].prompt_tokens.choice[1]", "must be >= 1"),
    ({"arrival_rate": 1, "requests": [{"name": "a", "output_tokens": -2}]}, "requests[0].output_tokens", ">= 0"),
    ({"arrival_rate": 1, "requests": [{"name": "a", "output_tokens": 1, "weight": 0}]}, "requests[0].weight", "> 0"),
    ({"arrival_rate": 1, "requests": [{"name": "a", "output_tokens": 1, "params": [1]}]}, "requests[0].params",
     "must be a mapping"),
    ({"arrival_rate": 1, "requests": [{"name": "a", "output_tokens": 1, "colour": "red"}]}, "requests[0].colour",
     "unknown field"),
    ({"arrival_rate": 1, "requests": [{"name": "a", "output_tokens": 1}, {"name": "a", "output_tokens": 2}]},
     "requests[1].name", "used twice"),
    ({"arrival_rate": 1, "rate": 2, "requests": [{"name": "a", "output_tokens": 1}]}, "rate", "unknown field"),
])
def test_bad_fields_are_named(doc, field, why):
    with pytest.raises(WorkloadError, match=why) as e:
        parse_workload(doc)
    assert str(e.value).startswith(f"{field}: ") and e.value.field == field


def test_bad_files(tmp_path):
    with pytest.raises(WorkloadError, match="cannot read workload file"):
        load_workload(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("arrival_rate: [1\n")
    with pytest.raises(WorkloadError, match="not valid YAML"):
        load_workload(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(WorkloadError, match="a workload is a mapping"):
        load_workload(bad)


def test_slo_strings():
    slo = parse_slo("ttft_p95<=500ms, tpot_p99.9<=0.05,e2e_p50<=2s")
    assert [(o.metric, o.percentile, o.limit_s) for o in slo.objectives] == \
        [("ttft", 95, 0.5), ("tpot", 99.9, 0.05), ("e2e", 50, 2.0)]
    assert str(slo) == "ttft_p95<=500ms,tpot_p99.9<=50ms,e2e_p50<=2000ms"
    samples = {"ttft": [0.1] * 95 + [0.9] * 5, "tpot": [0.01] * 100, "e2e": [1.0, 3.0, 1.5]}
    verdicts = slo.evaluate(samples)
    assert [v.met for v in verdicts] == [True, True, True] and slo.met(samples)
    samples["ttft"] = [0.1] * 90 + [0.9] * 10
    assert [v.met for v in slo.evaluate(samples)] == [False, True, True]
    assert not slo.met({"ttft": [0.1]})  # no tpot / e2e samples: not met
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5


@pytest.mark.parametrize(("text", "why"), [
    ("", "one or more objectives"), ("ttft<=1", "cannot read objective"), ("latency_p95<=1", "unknown metric"),
    ("ttft_p0<=1", r"\(0, 100\]"), ("ttft_p101<=1", r"\(0, 100\]"), ("ttft_p95<=0ms", "must be > 0"),
    ("ttft_p95<=1,ttft_p95<=2", "given twice"), ("ttft_p95>=1", "cannot read objective"),
])
def test_bad_slo_strings(text, why):
    with pytest.raises(SLOError, match=why):
        parse_slo(text)
