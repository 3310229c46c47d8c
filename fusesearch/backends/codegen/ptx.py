"""The warp-level tensor-core instructions a CUDA kernel calls as device functions (a generator leaf).

Problem: `mma.sync` operands live in registers spread over 32 lanes in the PTX ISA's per-shape
layout; the kernel text must be the same on the GPU and in the emulator, which has no inline PTX.
Approach: `MMA_SYNC` is CUDA text inside `#ifndef FS_EMULATED`; the emulator defines the same names
as warp-collective C++. Per lane (g = lane >> 2, t = lane % 4): `fs_tf32` (cvt.rna),
`fs_mma_m16n8k8_tf32` (a[i] = A[g + 8 (i & 1)][t + 4 (i >> 1)], b[i] = B[t + 4 i][g]),
`fs_mma_m16n8k16_f16` / `_bf16` (a[i] = A[g + 8 (i & 1)][2t + 8 (i >> 1) + {0,1}],
b[i] = B[2t + 8 i + {0,1}][g]), c[i], d[i] = C[g + 8 (i >> 1)][2t + (i & 1)];
`fs_ldmatrix_x{1,2,4}` (lanes 8j..8j+7 give matrix j's 16-byte rows; r[j] = M_j[g][2t + {0,1}])
and `_trans` (r[j] = M_j[2t + {0,1}][g]). A TF32 operand is read from its top 19 bits, so round
with `fs_tf32` first.
Invariants: every function is warp-collective (all 32 lanes, converged); the text is a pure
constant (part of the source hash of every kernel that includes it)."""

from __future__ import annotations

_LDMATRIX = """__device__ __forceinline__ void fs_ldmatrix_x{n}{suffix}(unsigned* r, const void* p) {{
    asm volatile("ldmatrix.sync.aligned.m8n8.x{n}{trans}.shared.b16 {{{outs}}}, [%{n}];\\n"
                 : {regs} : "r"((unsigned)__cvta_generic_to_shared(p)));
}}
"""
_MMA = """__device__ __forceinline__ void fs_mma_m16n8k{k}_{name}(float* d, const unsigned* a, const unsigned* b, const float* c) {{
    asm volatile("mma.sync.aligned.m16n8k{k}.row.col.f32.{ptx}.{ptx}.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, "
                 "{{%10,%11,%12,%13}};\\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                   "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}}
"""


def _ldmatrix(n: int, trans: bool) -> str:
    return _LDMATRIX.format(n=n, suffix="_trans" if trans else "", trans=".trans" if trans else "",
                            outs=",".join(f"%{i}" for i in range(n)),
                            regs=", ".join(f'"=r"(r[{i}])' for i in range(n)))


MMA_SYNC = "".join([
    "#ifndef FS_EMULATED\n",
    "__device__ __forceinline__ unsigned fs_tf32(float x) {\n"
    '    unsigned r; asm("cvt.rna.tf32.f32 %0, %1;\\n" : "=r"(r) : "f"(x)); return r;\n}\n',
    _MMA.format(k=8, name="tf32", ptx="tf32"),
    _MMA.format(k=16, name="f16", ptx="f16"),
    _MMA.format(k=16, name="bf16", ptx="bf16"),
    *(_ldmatrix(n, trans) for n in (1, 2, 4) for trans in (False, True)),
    "#endif\n",
])
