"""The ``CMAKE_ARGS`` ``make bench-peers`` builds llama-cpp-python with: llama.cpp's x86 instruction-set
switches turned on for what this CPU has (``/proc/cpuinfo``), instead of ``GGML_NATIVE``.

Why not native: on a Xeon with AMX, ``-march=native`` compiles llama.cpp's AMX int8 path in (even with
``-DGGML_AMX_INT8=OFF``, since the compiler then defines ``__AMX_INT8__``), and that build crashed at the
first decode of a Q4_1 file; the explicit switches below (AMX off) run. Elsewhere (not x86, no cpuinfo)
it prints nothing and llama.cpp's own default (native) applies. Run by the system python; imports
nothing of mstar.
"""

from __future__ import annotations

import platform
import sys

# /proc/cpuinfo flag -> llama.cpp's CMake switch
SWITCHES = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C", "avx512f": "GGML_AVX512",
            "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16"}


def cmake_args(flags: set[str]) -> str:
    args = ["-DGGML_NATIVE=OFF", *(f"-D{switch}={'ON' if flag in flags else 'OFF'}" for flag, switch in SWITCHES.items()),
            "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return " ".join(args)


def main() -> int:
    if platform.machine() not in ("x86_64", "AMD64"):
        return 0
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return 0
    if line:
        print(cmake_args(set(line.split(":", 1)[1].split())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
