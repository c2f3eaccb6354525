"""The PTX a quantize or dequantize kernel may contain, so that a GPU writes the torch reference's
bytes (tests/test_kernels_compile.py applies it to every variant the recipes launch).

The reference runs on the CPU, where torch computes FP32 division by IEEE round-to-nearest, rounds
every product and every sum on its own (no fused multiply-add) and keeps subnormals. A kernel's
bytes can differ from it exactly where its PTX says otherwise:

- `fma` / `mad` on a float type: a*b+c rounded once instead of twice (FP contraction: LLVM emits
  fma.rn.f32 for a*b+c when `enable_fp_fusion` is on, the default);
- `add` / `sub` / `mul` on a float type without `.rn`: the PTX ISA lets ptxas fuse a mul and an
  add that carry no rounding modifier into an FMA (and it does unless --fmad=false); an
  explicit `.rn` forbids it. So the FMA-free rule is checkable on the PTX alone, with no data flow;
- `div`, `rcp`, `sqrt` without `.rn`: `.approx` and `.full` (what a plain `/` between FP32
  values lowers to) are not correctly rounded; `div.rn` (tl.math.div_rn) is;
- any `.approx` instruction (ex2, lg2, rsqrt, sin, ...): no twin in the reference;
- `.ftz` anywhere: subnormal inputs or results become zero (e.g. tl.floor through libdevice
  becomes cvt.rmi.ftz.f32.f32 unless `enable_reflect_ftz` is off); NVFP4's decoded scale
  times s2 can be subnormal;
- rounding arithmetic (add, sub, mul, div, fma, ...) on a type other than f32 / f32x2: the
  reference upcasts to FP32 first (abs, neg, min, max and compares are exact in any type);
- `cvt` to an FP8/FP4 type: elements are encoded by integer bit math, because the hardware
  cast's rounding and saturation differ from the interpreter's (triton_quant's docstring).

Integer instructions (mad.wide.s32, div.s32, ...) are not float arithmetic and are allowed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FLOAT_TYPES = {"f16", "f16x2", "bf16", "bf16x2", "f32", "f32x2", "f64"}
FP32_TYPES = {"f32", "f32x2"}
ROUNDING_OPS = {"add", "sub", "mul", "div", "rcp", "sqrt", "fma", "mad"}
NARROW_FLOAT_MODS = {"e4m3x2", "e5m2x2", "e2m1x2", "e2m3x2", "e3m2x2", "ue8m0x2"}
_INSTRUCTION = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.]*)")


@dataclass(frozen=True)
class Finding:
    line: int
    text: str  # the PTX instruction as written
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: `{self.text}`: {self.reason}"


def _reason(opcode: str) -> str | None:
    base, *mods = opcode.split(".")
    types = [m for m in mods if m in FLOAT_TYPES]
    if "ftz" in mods:
        return "flush-to-zero: subnormals become 0, torch keeps them"
    if base == "cvt" and NARROW_FLOAT_MODS & set(mods):
        return "hardware FP8/FP4 cast: encode by integer bit math"
    if not types:
        return None  # integer, bit, memory and control instructions
    if "approx" in mods:
        return "approximate: not correctly rounded"
    if base in ("fma", "mad"):
        return "fused multiply-add: a*b+c rounded once, torch rounds a*b and the sum apart"
    if base not in ROUNDING_OPS:
        return None  # abs, neg, min, max, setp, selp, cvt: exact
    if not FP32_TYPES.issuperset(types):
        return f"arithmetic in {'/'.join(types)}: torch rounds in FP32"
    if "rn" not in mods:
        if base in ("add", "sub", "mul"):
            return "no .rn: ptxas may contract it with a neighbour into an FMA"
        return "not correctly rounded (.full): use tl.math.div_rn"
    return None


def findings(ptx: str) -> list[Finding]:
    """Every instruction of `ptx` that can make a kernel's bytes differ from the torch reference."""
    out = []
    for number, line in enumerate(ptx.splitlines(), 1):
        text = line.split("//", 1)[0].strip()
        m = _INSTRUCTION.match(text)
        if not m:
            continue  # directives (.reg, .param, ...), labels, braces, comments
        reason = _reason(m.group(1))
        if reason:
            out.append(Finding(number, text.rstrip(";"), reason))
    return out


def summary(found: list[Finding], limit: int = 5) -> str:
    """One line per distinct opcode and reason, with a count and the first occurrence."""
    groups: dict[tuple[str, str], list[Finding]] = {}
    for f in found:
        groups.setdefault((_INSTRUCTION.match(f.text).group(1), f.reason), []).append(f)
    lines = [f"{len(fs)} x {op} ({reason}), first {fs[0]}" for (op, reason), fs in groups.items()]
    return "\n".join(lines[:limit] + ([f"... {len(lines) - limit} more"] if len(lines) > limit else []))
