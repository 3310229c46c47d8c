"""bert-small's attention score group (second layer): the keys packed per head, the product
Q K^T, then scale, mask and Softmax over each row. What the exponentials cost (taken out: a
bound)."""
MODEL = "bert-small"
NODES = ("transpose_4", "transpose_5", "matmul_11", "div_5", "add_21", "softmax_1")
VARIANTS = {"exp taken out": [(r"= fs_expf_le\(", "= (")]}
BOUNDS = ("exp taken out",)
