"""The device mesh's axis names, one home for all of them.

"tensor": tensor parallelism (heads, MLP columns, vocabulary, experts under EP = TP);
"data": DP attention ranks; "expert": the axis of a standalone expert-parallel mesh.
"""

TENSOR = "tensor"
DATA = "data"
EXPERT = "expert"
