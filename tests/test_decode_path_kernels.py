"""Guards of the engine's compiled decode path: the kernels a steady decode step is meant to run are
the ones it runs (not a PyTorch fallback), and the panel linear's build keeps every register tile's
accumulators in registers.

A fallback or a badly compiled tile does not change any result, only the speed, so no parity test
notices it; these do, in a few seconds, on the machine that runs the suite.
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from mstar.layers import cpu_ops as cpu_ops_mod

pytestmark = pytest.mark.skipif(cpu_ops_mod.ops() is None, reason="the compiled CPU kernels are unavailable here")


class _Counting:
    """Stands in for the loaded extension: counts every call of every kernel, then forwards."""

    def __init__(self, real):
        self.real, self.calls = real, collections.Counter()

    def __getattr__(self, name):
        fn = getattr(self.real, name)
        if not callable(fn):
            return fn

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)

        return counted


_FALLBACKS = {  # what the decode path would call if a kernel were not taken
    "F.linear": (F, "linear"),
    "F.scaled_dot_product_attention": (F, "scaled_dot_product_attention"),
    "torch.matmul": (torch, "matmul"),
    "torch.addmm": (torch, "addmm"),
}


def _calls_of_generate(monkeypatch, max_tokens: int) -> collections.Counter:
    """Kernel calls (and fallback calls, keyed by their names above) of one greedy llama-tiny
    generate of ``max_tokens`` tokens, EOS ignored: the model is built inside, so its layers look
    the counting extension up."""
    from mstar.layers import attention_backends
    from mstar.runtime.api import Runtime

    for name in ("MSTAR_KERNELS", "MSTAR_ATTENTION_KERNEL", "MSTAR_PREPACK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(attention_backends, "_INSTANCES", {})
    counting = _Counting(cpu_ops_mod._EXTENSION.build())
    monkeypatch.setattr(cpu_ops_mod._EXTENSION, "_state", {"module": counting})
    for key, (owner, attr) in _FALLBACKS.items():
        real = getattr(owner, attr)

        def fallback(*args, _real=real, _key=key, **kwargs):
            counting.calls[_key] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, attr, fallback)
    with Runtime("llama-tiny") as rt:
        out = rt.generate([{"input_ids": torch.tensor([1, 5, 9, 14, 22, 3])}],
                          {"max_tokens": max_tokens, "sampling": {"ignore_eos": True}})
    tokens = len(out[0].outputs.get("token", []))
    assert out[0].finished and tokens == max_tokens, (out[0].outputs.keys(), tokens)
    monkeypatch.undo()
    return counting.calls


def test_a_decode_step_runs_the_compiled_kernels_and_no_fallback(monkeypatch):
    """The extra calls of 6 decode steps (a generate of 8 tokens minus one of 2: same prompt, same
    prefill) are, per step and layer, one compiled fused attention step, the four panel linears
    (q/k/v, o + residual, gate/up + SiLU-mul, down + residual), two RMSNorms and one rotary; per
    step the final norm and the head; and not one PyTorch linear, matmul or attention, prefill
    included."""
    from mstar.models.llama.config import TINY

    short, long = _calls_of_generate(monkeypatch, 2), _calls_of_generate(monkeypatch, 8)
    steps, layers = 6, TINY.num_hidden_layers
    delta = {k: long[k] - short[k] for k in set(long) | set(short)}
    assert delta.get("decode_step", 0) == steps * layers, delta  # the fused step: one call a layer
    head = delta.get("linear_argmax", 0)
    assert delta.get("linear", 0) == steps * (4 * layers + 1) - head, delta
    assert delta.get("rms_norm", 0) == steps * (2 * layers + 1), delta
    assert delta.get("rotary_", 0) == steps * layers, delta
    assert delta.get("paged_decode", 0) == 0 and delta.get("store_kv_", 0) == 0, delta  # the unfused path
    for key in _FALLBACKS:
        assert long[key] == 0, (key, long)  # prefill included


def _innermost_loops(disassembly: str):
    """(first address, last address, instructions) of every innermost loop (a backward branch
    holding no other) in one function's ``objdump -d`` text."""
    lines = []
    for ln in disassembly.splitlines():
        m = re.match(r"\s+([0-9a-f]+):\s+(.*)", ln)
        if m:
            lines.append((int(m.group(1), 16), m.group(2)))
    back = []
    for addr, ins in lines:
        m = re.match(r"j\w+\s+([0-9a-f]+)\b", ins)
        if m and int(m.group(1), 16) < addr:
            back.append((int(m.group(1), 16), addr))
    for lo, hi in back:
        if any(lo <= lo2 and hi2 <= hi and (lo2, hi2) != (lo, hi) for lo2, hi2 in back):
            continue
        yield lo, hi, [ins for addr, ins in lines if lo <= addr <= hi]


def test_panel_tiles_keep_their_accumulators_in_registers():
    """No inner loop of the float32 panel linear stores a vector register to the stack as often as it
    multiplies: a tile whose accumulators live in memory (a store per multiply-add) ran a 16-row
    decode step's linears ~15% slower, a loss no result shows. AVX-512 builds (the tiles are
    written for 32 vector registers)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    lib = cpu_ops_mod.ops().__file__
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", "-C", lib], capture_output=True, text=True,
                          check=True).stdout
    if "zmm" not in text:
        pytest.skip("not an AVX-512 build")
    functions = [f for f in re.split(r"\n(?=[0-9a-f]+ <)", text)
                 if "run<false, float, float, float>" in f.split("\n", 1)[0]]
    assert functions, "the float32 panel linear's task loop was not found in the build"
    tile_loops = spilling = 0
    for body in functions:
        for lo, hi, loop in _innermost_loops(body):
            fma = sum("vfmadd" in ins for ins in loop)
            stores = sum(re.match(r"vmov\w+\s+%zmm\d+,.*\(%rsp\)", ins) is not None for ins in loop)
            if fma >= 4:
                tile_loops += 1
                if stores >= fma // 2:
                    spilling += 1
                    print(f"loop {lo:x}-{hi:x}: {fma} multiply-adds, {stores} vector stores to the stack")
    assert tile_loops >= 6, f"expected the 1..6-row tiles' loops, found {tile_loops}"
    assert spilling == 0, f"{spilling} tile loops keep their accumulators in memory"
