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
import sys
import time

from json_lines import answers_channel, generation, serve  # beside this script (peers/json_lines.py)


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--audio-constraint", action="store_true",
                    help="load vllm_audio_codes.AudioCodeConstraint (requests opt in per call)")
    return ap.parse_args()


def _load(args: argparse.Namespace):
    """(the ``LLM``, the hello line's fields)."""
    t0 = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM

    extra = {"logits_processors": ["vllm_audio_codes:AudioCodeConstraint"]} if args.audio_constraint else {}
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, seed=args.seed, **extra)
    return llm, {"vllm": vllm.__version__, "torch": torch.__version__,
                 "startup_s": time.perf_counter() - t0}


class _Peer:
    """The commands, over one loaded ``LLM``."""

    def __init__(self, llm, out) -> None:
        self.llm, self.out, self.streams = llm, out, 0

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        res = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in res]

    def stream(self, prompts: list[list[int]], max_tokens: int, sampling: dict, audio_codes: dict | None) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self.streams += 1
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA,
                            extra_args={"audio_codes": audio_codes} if audio_codes else None, **sampling)
        engine = self.llm.llm_engine
        index = {}
        for i, p in enumerate(prompts):
            rid = f"stream{self.streams}-{i}"
            index[rid] = i
            engine.add_request(rid, TokensPrompt(prompt_token_ids=p), sp)
        while engine.has_unfinished_requests():
            step = [[index[o.request_id], list(o.outputs[0].token_ids)]
                    for o in engine.step() if o.outputs and o.outputs[0].token_ids]
            if step:
                print(json.dumps({"step": step}), file=self.out, flush=True)

    def answer(self, cmd: dict) -> dict:
        """The answer to one ``concurrent`` / ``sequential`` / ``stream`` command."""
        if cmd["cmd"] == "stream":
            t0 = time.perf_counter()
            self.stream(cmd["prompts"], int(cmd["max_tokens"]), cmd.get("sampling") or {}, cmd.get("audio_codes"))
            return {"wall_s": time.perf_counter() - t0}
        return generation(self.generate, cmd)


def main() -> int:
    args = _args()
    out = answers_channel()

    def start():
        llm, hello = _load(args)
        return hello, _Peer(llm, out).answer

    return serve(out, start)


if __name__ == "__main__":
    sys.exit(main())
