"""bert-small's attention score group (second layer): the keys packed per head, the product
Q K^T, then scale, mask and Softmax over each row. What the exponentials cost (taken out: a
bound)."""
MODEL = "bert-small"
GROUP = "Transpose+Transpose+MatMul+Div+Add+Softmax"
VARIANTS = {"exp taken out": [(r"= fs_expf_le\(", "= (")]}
BOUNDS = ("exp taken out",)
