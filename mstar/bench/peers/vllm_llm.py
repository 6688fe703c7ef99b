"""vLLM CPU peer of ``mstar bench compare llm``; run by the peer virtualenv's python, never imported.

Loads the checkpoint once (token ids in: no tokenizer), prints ``{"ready": true, ...}`` as one JSON
line, then answers one JSON line per command read from stdin:

* ``{"cmd": "concurrent", "prompts": [[ids]], "max_tokens": N}``: one ``LLM.generate`` over every
  prompt (vLLM batches them continuously);
* ``{"cmd": "sequential", ...}``: one ``generate`` per prompt, in turn;
* ``{"cmd": "stream", "prompts": [[ids]], "max_tokens": N, "sampling": {SamplingParams fields},
  "audio_codes": {...} or null}``: every prompt added to vLLM's engine at once, the engine stepped
  until all are done; after each step that made tokens, one line ``{"step": [[prompt index, [new
  ids]], ...]}`` (so the driver sees tokens as an ``AsyncLLM`` client would), then the answer
  ``{"wall_s"}``. ``audio_codes`` (needs ``--audio-constraint``): see ``vllm_audio_codes.py``;
* ``{"cmd": "quit"}``.

Answers: ``{"wall_s", "request_s": [per request], "tokens": [[ids]]}`` or ``{"error"}``. Greedy
(``stream``: the sampling sent), ``ignore_eos``, fp32 unless ``--dtype``. vLLM's own logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--audio-constraint", action="store_true",
                    help="load vllm_audio_codes.AudioCodeConstraint (requests opt in per call)")
    args = ap.parse_args()
    # answers go to the original stdout only; everything else that writes to fd 1 (vLLM's engine
    # processes inherit it) lands in stderr
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        t0 = time.perf_counter()
        import torch
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        extra = {"logits_processors": ["vllm_audio_codes:AudioCodeConstraint"]} if args.audio_constraint else {}
        llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, seed=args.seed, **extra)
        startup = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - reported to the driver
        traceback.print_exc()
        print(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}), file=out, flush=True)
        return 1
    print(json.dumps({"ready": True, "vllm": vllm.__version__, "torch": torch.__version__, "startup_s": startup}),
          file=out, flush=True)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in res]

    streams = 0

    def stream(prompts: list[list[int]], max_tokens: int, sampling: dict, audio_codes: dict | None) -> None:
        nonlocal streams
        streams += 1
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA,
                            extra_args={"audio_codes": audio_codes} if audio_codes else None, **sampling)
        engine = llm.llm_engine
        index = {}
        for i, p in enumerate(prompts):
            rid = f"stream{streams}-{i}"
            index[rid] = i
            engine.add_request(rid, TokensPrompt(prompt_token_ids=p), sp)
        while engine.has_unfinished_requests():
            step = [[index[o.request_id], list(o.outputs[0].token_ids)]
                    for o in engine.step() if o.outputs and o.outputs[0].token_ids]
            if step:
                print(json.dumps({"step": step}), file=out, flush=True)

    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                break
            prompts, n = cmd["prompts"], int(cmd["max_tokens"])
            t0 = time.perf_counter()
            if cmd["cmd"] == "stream":
                stream(prompts, n, cmd.get("sampling") or {}, cmd.get("audio_codes"))
                print(json.dumps({"wall_s": time.perf_counter() - t0}), file=out, flush=True)
                continue
            if cmd["cmd"] == "concurrent":
                tokens = generate(prompts, n)
                wall = time.perf_counter() - t0
                times = [wall] * len(prompts)
            elif cmd["cmd"] == "sequential":
                tokens, times = [], []
                for p in prompts:
                    t = time.perf_counter()
                    tokens += generate([p], n)
                    times.append(time.perf_counter() - t)
                wall = time.perf_counter() - t0
            else:
                raise ValueError(f"unknown command {cmd['cmd']!r}")
            ans = {"wall_s": wall, "request_s": times, "tokens": tokens}
        except Exception as e:  # noqa: BLE001 - reported to the driver
            traceback.print_exc()
            ans = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(ans), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
