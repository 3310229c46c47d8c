"""mobilenetv2's 1x1 conv 320->1280 at 7x7 with its Clip: 1.6 MiB of filters packed once, 49
pixels. `fs_packed_panels` runs each pair of 16-filter panels (40 KiB) over every 12-pixel panel
of the packed pixels, so a pair is read from memory by its first tile and from L1 by the other
four. Inside the whole program the filters come from memory (`bench_program.py`: the group 1.4-1.6x
slower inside than alone); run with `--flush 256` to time that, without it to time the kernel hot.
Measured and not kept: the pixel panels outer (every pair streamed once per pixel panel, the
filters one long run instead of one 40 KiB run per pair), and the next pair asked into L2 one
cache line per k step of the current pair's tiles (`__builtin_prefetch`, spread so that its
tiles have asked for all of it)."""
import re

GROUPS = [("mobilenetv2", ("conv_51", "clip_34"))]

_PAIR_OUTER = """    for (long long n0 = 0; n0 < N; ) {
        int panels = N - n0 > (FS_PANELS - 1) * FS_NR ? FS_PANELS : 1;
        long long nr = N - n0 < panels * FS_NR ? N - n0 : panels * FS_NR;
        for (long long i0 = 0; i0 < M; i0 += FS_AP) {
            const float *a = ap + i0 * K, *b = Bp + n0 * K;
            long long mr = M - i0 < FS_AP ? M - i0 : FS_AP;"""
_PIXELS_OUTER = """    for (long long i0 = 0; i0 < M; i0 += FS_AP) {
    for (long long n0 = 0; n0 < N; ) {
        int panels = N - n0 > (FS_PANELS - 1) * FS_NR ? FS_PANELS : 1;
        long long nr = N - n0 < panels * FS_NR ? N - n0 : panels * FS_NR;
        {
            const float *a = ap + i0 * K, *b = Bp + n0 * K;
            long long mr = M - i0 < FS_AP ? M - i0 : FS_AP;"""
_PAIR_END = "        n0 += panels * FS_NR;\n    }\n}"
_TILES = """        for (long long i0 = 0; i0 < M; i0 += FS_AP) {
            const float *a = ap + i0 * K, *b = Bp + n0 * K;
            long long mr = M - i0 < FS_AP ? M - i0 : FS_AP;"""
_TILES_ASKING = """        long long tiles = (M + FS_AP - 1) / FS_AP;
        long long next = N - n0 - panels * FS_NR;
        long long ahead = (next <= 0 ? 0 : next < FS_PANELS * FS_NR ? (next + FS_NR - 1) / FS_NR * FS_NR : FS_PANELS * FS_NR) * K * 4;
        long long per = (ahead + tiles - 1) / tiles;
        for (long long i0 = 0; i0 < M; i0 += FS_AP) {
            const float *a = ap + i0 * K, *b = Bp + n0 * K;
            long long mr = M - i0 < FS_AP ? M - i0 : FS_AP;
            fs_pf = (const char*)(b + panels * FS_NR * K) + (i0 / FS_AP) * per;
            fs_pf_step = per > 0 ? (per + K - 1) / K / 64 * 64 + 64 : 0;"""
_MICRO = "static inline __attribute__((always_inline)) void fs_micro_x2("
_LOOP = "#pragma GCC unroll 8\n    for (long long k = 0; k < K; ++k, a += ak, ahi += ak, b += FS_NR, b2 += FS_NR) {\n"

VARIANTS = {
    "pixel panels outer": [(re.escape(_PAIR_OUTER), _PIXELS_OUTER), (re.escape(_PAIR_END), _PAIR_END + "\n}")],
    "next pair asked per k step": [
        (re.escape(_MICRO), "static _Thread_local const char* fs_pf; static _Thread_local long long fs_pf_step;\n" + _MICRO),
        (re.escape(_LOOP), "    const char* pfp = fs_pf; long long pfs = fs_pf_step;\n" + _LOOP
         + "        __builtin_prefetch(pfp, 0, 2); pfp += pfs;\n"),
        (re.escape(_TILES), _TILES_ASKING)],
}
