"""bert-small's attention score group (second layer): the keys packed per head, the product
Q K^T, then scale, mask and Softmax over each row. What its parts cost, each taken out (bounds):
the exponentials, the keys' packing (the panels keep the previous call's keys) and the whole
scale + mask + Softmax pass over the rows (the product alone)."""
MODEL = "bert-small"
NODES = ("transpose_4", "transpose_5", "matmul_11", "div_5", "add_21", "softmax_1")
VARIANTS = {
    "exp taken out": [(r"= fs_expf_le\(", "= (")],
    "keys not packed": [(r"fs_pack_b\(64LL, 128LL, in1", "if (0) fs_pack_b(64LL, 128LL, in1")],
    "product only": [(r"for \(long long rp = 0; rp < 128LL; \+\+rp\)", "for (long long rp = 0; rp < 0LL; ++rp)")],
}
BOUNDS = ("exp taken out", "keys not packed", "product only")
