"""The NCHWc conv's work items shared among threads (`schedule.NchwcItems`): blocks of output rows
whose count is cut to a multiple of the threads, bounded at OH - (count - k) x OH / count (each
thread's rows differ by one at most, the larger blocks first), against the blocks as they were:
fixed blocks of the least rows (14 rows in 4, 4, 4, 2: 8 and 6 rows on two threads), and the
bounds spread but not cut to the threads; and the base's own code again (a pair of parentheses
added), a control whose ratio is the timing's bias and noise.
resnet18's convs at 56, 28, 14 and 7 pixels a side and mobilenetv2's last depthwise conv, in
channel blocks (LAYOUT), run at OMP_NUM_THREADS threads:

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/ab_group.py benchmarks/variants/nchwc_items.py

Measured and kept (2026-12-07, 2-core Zen 3 EPYC VM, AVX2: blocks of 8, 2 threads, 9 interleaved
rounds; each variant's time over the base's): 56 x 56 conv 0.99 / 0.98 (control 0.995); 28 x 28
1.07 / 1.09 (0.99); 14 x 14 1.02 / 0.90 (1.00); 14 x 14 with the residual 1.10 / 1.06 (1.005);
7 x 7 1.05 / 1.04 (0.99); the 7 x 7 depthwise conv 0.95 / 0.98 (1.07, a 0.11 ms kernel). Where
the partition is the same as the base's (28 x 28 and 7 x 7 at two threads: 14 and 1 blocks) the
variants differ only in the block count written as a constant, and still by 4-9% either way:
the compiler's code for the loop moves these kernels as much as the split does, so only the
14 x 14 residual conv's 1.10 (and the per-kernel traces of resnet18's 14 x 14 convs, 1.78-1.81x
faster at two threads than at one before, 1.89-2.0x after) speaks for the split itself."""
LAYOUT = "nchwc"
GROUPS = [("resnet18", ("conv_3", "relu_3")), ("resnet18", ("conv_8", "relu_7")),
          ("resnet18", ("conv_13", "relu_11")), ("resnet18", ("conv_14", "sum_5", "relu_12")),
          ("resnet18", ("conv_18", "relu_15")), ("mobilenetv2", ("conv_49", "clip_33"))]
_CUT = (r"long long nt = fs_threads\(\), blocks = (\d+)LL >= nt \? \d+LL - \d+LL % nt : \d+LL;",
        r"long long nt = fs_threads(), blocks = \1LL;")
_FIXED = (r"long long oh0 = (\d+)LL - \(blocks - rb\) \* \d+LL / blocks, oh1 = [^;]*;",
          r"long long rr = (\1LL + blocks - 1) / blocks, oh0 = rb * rr, oh1 = oh0 + rr < \1LL ? oh0 + rr : \1LL;")
VARIANTS = {
    "fixed blocks of the least rows": [_CUT, _FIXED],
    "bounds spread, count not cut": [_CUT],
    "the same source (a control: the order's bias)": [(r"long long per = blocks \* ", "long long per = (blocks) * ")],
}
