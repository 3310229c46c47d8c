"""ONNX's own backend node test cases, each a single-node group, on the CPU backend.

Problem: the code generator's per-op formulas are checked elsewhere on a few hand-built graphs
only; an attribute default it ignores or an edge case it gets wrong (negative indices, NaN, an
omitted optional input) would go unnoticed. ONNX ships a test case per op and edge case.
Approach: collect every node test case whose model is one node of an op the generator lowers
(the keys of its op tables, so this stays in sync) — from `onnx/backend/test/data/node` when the
installed onnx has that folder, else generated in memory by `onnx.backend.test.case.node` (the
code that writes that folder). Each case is prepared like a user's model, lowered as one group,
generated, compiled and run on its inputs, and compared with its expected outputs.
The inputs an op reads as parameters (Slice starts, Reshape shape, Clip bounds, Reduce axes, ...)
become initializers first: fusesearch needs static shapes and constant parameters, as exported
models have them; the data inputs stay graph inputs.
Invariants: a case passes, or is refused (a dtype without a C type, a reduction over outer axes,
a loader, generator or library-call refusal: the loader alone decides what a zero-size input is) AND is on `KNOWN_UNSUPPORTED`, the
explicit list of known unsupported cases with their reasons — then it skips with that reason. A
refusal not on the list fails; a listed case that now runs fails too ("remove it from the list"),
so the list only shrinks; a listed case refused for another reason than its entry says, or one
giving a wrong value or crashing, fails. `test_summary` lists the covered ops and every refusal.
"""

from __future__ import annotations

import re
import tempfile
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from fusesearch.backends import cpu
from fusesearch.backends.codegen import CTYPES, GENERATED_OPS, CodegenRefused, generate
from fusesearch.errors import BadInput
from fusesearch.groups import FusionGroup
from fusesearch.ir.canonicalize import to_proto
from fusesearch.ir.load import MIN_OPSET, TARGET_OPSET
from fusesearch.lowering import _lower_checked, reduced_rows, try_lower
from fusesearch.pipeline import prepare
from fusesearch.verify import all_values

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler")

COVERED_OPS = GENERATED_OPS
# generated ops onnx ships no node case for (checked against ONNX Runtime in test_codegen_coverage.py)
WITHOUT_NODE_CASES = frozenset({"GlobalLpPool"})
DATA_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "node"

# inputs read as parameters (constants in exported models): made initializers before `prepare`;
# CastLike's second input gives only its dtype (onnx's cases give an empty tensor)
PARAMETER_INPUTS = {"Clip": (1, 2), "Slice": (1, 2, 3, 4), "Reshape": (1,), "Expand": (1,), "Split": (1,),
                    "Squeeze": (1,), "Unsqueeze": (1,), "Resize": (1, 2, 3), "ReduceMean": (1,),
                    "ReduceSum": (1,), "ReduceMax": (1,), "ReduceMin": (1,), "ReduceL1": (1,), "ReduceL2": (1,),
                    "ReduceSumSquare": (1,), "ReduceLogSum": (1,), "ReduceLogSumExp": (1,), "Pad": (1, 2, 3),
                    "Tile": (1,), "Trilu": (1,), "OneHot": (1,), "CenterCropPad": (1,), "Dropout": (1, 2),
                    "CastLike": (1,)}


@dataclass(frozen=True)
class Unsupported:
    """Why a case is known not to run, and the refusal (a regex) it must still end in."""
    reason: str
    refusal: str


DTYPE = Unsupported("a dtype outside the generator's C types (float32, float16, bfloat16, int32, int64, bool)",
                    r"^dtype \S+ has no C type in the generator")
EMPTY_INPUT = Unsupported("a zero-size graph input (the expanded CastLike cases keep one that no node reads): the "
                          "loader reads a 0 dim as an unknown one, says zero-size tensors are not supported and asks for "
                          "--input-shape (exported models have no empty tensors)",
                          r"^the loader refuses the model: .*input '\S+' has unbound dynamic dim \d+ \(given as 0: read as "
                          r"unknown, zero-size tensors are not supported\); "
                          r"bind it with --input-shape ")
OUTER_AXES = Unsupported("a reduction over outer axes: the rowwise template reduces the innermost axes only",
                         r"^not supported yet: .*reduces axes \[[-\d, ]+\], not the innermost ones")
RESIZE_MODE = Unsupported("Resize cubic interpolation, antialiased linear downsampling or tf_crop_and_resize "
                          "coordinates: the generator emits nearest and linear with the other coordinate modes",
                          r"^generator refuses: .*\(Resize\) (mode (cubic|linear with antialias)|coordinate mode \w+) "
                          r"has no code generator yet")
TRAINING = Unsupported("training mode (BatchNormalization's batch statistics, Dropout's mask): the "
                       "generator writes inference kernels", r"^generator refuses: .*in training mode is not generated")
RANDOM_DROPOUT = Unsupported("Dropout in training mode with a nonzero ratio: ONNX Runtime zeroes values at random",
                             r"^the loader refuses the model: .*\(Dropout\) runs in training mode")
MVN_DEFAULT_AXES = Unsupported("MeanVarianceNormalization without an axes attribute: onnx's shape inference "
                               "fails on its function body at opset 21 (and its default axes 0, 2, 3 are not inner)",
                               r"^the loader refuses the model: .*MeanVarianceNormalization.*One and only one of the "
                               r"attributes")
NOT_TENSOR = Unsupported("an optional or sequence input, not a tensor",
                         r"^input '\S+' is dynamic \(not a tensor of static shape\)")
CONVT_SAME = Unsupported("ConvTranspose with auto_pad SAME_*: explicit pads only",
                         r"^generator refuses: .*\(ConvTranspose\) auto_pad SAME_(UPPER|LOWER) is not generated yet")
POOL_NOT_2D = Unsupported("a 1-D or 3-D MaxPool/AveragePool: the generated window is 2-D (the rest run as library "
                          "calls)", r"^not supported yet: lowered as a library call \(\S+\((MaxPool|AveragePool)\): "
                                    r"(MaxPool|AveragePool) is generated for 2-D NCHW inputs only\)")
POOL_INDICES = Unsupported("MaxPool's Indices output (argmax positions): a library call",
                           r"^not supported yet: lowered as a library call \(\S+\(MaxPool\): MaxPool's Indices output "
                           r"is not generated")
POOL_AVERAGE_DILATED = Unsupported("a dilated AveragePool (opset 19): a library call",
                                   r"^not supported yet: lowered as a library call \(\S+\(AveragePool\): AveragePool with "
                                   r"dilations \[[\d, ]+\] is not generated")

# The node cases known not to run, by reason (written against onnx 1.23's cases). A refused case
# not listed here fails; a listed case that runs fails ("remove it"): the list only shrinks.
_LISTED = (
    (EMPTY_INPUT, """
        test_castlike_BFLOAT16_to_FLOAT_expanded test_castlike_DOUBLE_to_FLOAT16_expanded
        test_castlike_DOUBLE_to_FLOAT_expanded test_castlike_FLOAT16_to_DOUBLE_expanded
        test_castlike_FLOAT16_to_FLOAT4E2M1_expanded test_castlike_FLOAT16_to_FLOAT8E4M3FNUZ_expanded
        test_castlike_FLOAT16_to_FLOAT8E4M3FN_expanded test_castlike_FLOAT16_to_FLOAT8E5M2FNUZ_expanded
        test_castlike_FLOAT16_to_FLOAT8E5M2_expanded test_castlike_FLOAT16_to_FLOAT_expanded
        test_castlike_FLOAT16_to_INT2_expanded test_castlike_FLOAT16_to_INT4_expanded
        test_castlike_FLOAT16_to_UINT2_expanded test_castlike_FLOAT16_to_UINT4_expanded
        test_castlike_FLOAT4E2M1_to_FLOAT16_expanded test_castlike_FLOAT4E2M1_to_FLOAT_expanded
        test_castlike_FLOAT8E4M3FNUZ_to_FLOAT16_expanded test_castlike_FLOAT8E4M3FNUZ_to_FLOAT_expanded
        test_castlike_FLOAT8E4M3FN_to_FLOAT16_expanded test_castlike_FLOAT8E4M3FN_to_FLOAT_expanded
        test_castlike_FLOAT8E5M2FNUZ_to_FLOAT16_expanded test_castlike_FLOAT8E5M2FNUZ_to_FLOAT_expanded
        test_castlike_FLOAT8E5M2_to_FLOAT16_expanded test_castlike_FLOAT8E5M2_to_FLOAT_expanded
        test_castlike_FLOAT_to_BFLOAT16_expanded test_castlike_FLOAT_to_DOUBLE_expanded
        test_castlike_FLOAT_to_FLOAT16_expanded test_castlike_FLOAT_to_FLOAT4E2M1_expanded
        test_castlike_FLOAT_to_FLOAT8E4M3FNUZ_expanded test_castlike_FLOAT_to_FLOAT8E4M3FN_expanded
        test_castlike_FLOAT_to_FLOAT8E5M2FNUZ_expanded test_castlike_FLOAT_to_FLOAT8E5M2_expanded
        test_castlike_FLOAT_to_INT2_expanded test_castlike_FLOAT_to_INT4_expanded
        test_castlike_FLOAT_to_UINT2_expanded test_castlike_FLOAT_to_UINT4_expanded
        test_castlike_INT2_to_FLOAT16_expanded test_castlike_INT2_to_FLOAT_expanded
        test_castlike_INT2_to_INT8_expanded test_castlike_INT4_to_FLOAT16_expanded
        test_castlike_INT4_to_FLOAT_expanded test_castlike_INT4_to_INT8_expanded
        test_castlike_UINT2_to_FLOAT16_expanded test_castlike_UINT2_to_FLOAT_expanded
        test_castlike_UINT2_to_UINT8_expanded test_castlike_UINT4_to_FLOAT16_expanded
        test_castlike_UINT4_to_FLOAT_expanded test_castlike_UINT4_to_UINT8_expanded
        test_castlike_no_saturate_FLOAT16_to_FLOAT8E4M3FNUZ_expanded
        test_castlike_no_saturate_FLOAT16_to_FLOAT8E4M3FN_expanded
        test_castlike_no_saturate_FLOAT16_to_FLOAT8E5M2FNUZ_expanded
        test_castlike_no_saturate_FLOAT16_to_FLOAT8E5M2_expanded
        test_castlike_no_saturate_FLOAT_to_FLOAT8E4M3FNUZ_expanded
        test_castlike_no_saturate_FLOAT_to_FLOAT8E4M3FN_expanded
        test_castlike_no_saturate_FLOAT_to_FLOAT8E5M2FNUZ_expanded
        test_castlike_no_saturate_FLOAT_to_FLOAT8E5M2_expanded test_reduce_l1_empty_set
        test_reduce_l2_empty_set test_reduce_log_sum_empty_set test_reduce_log_sum_exp_empty_set
        test_reduce_max_empty_set test_reduce_max_empty_set_bool test_reduce_min_empty_set
        test_reduce_sum_empty_set test_reduce_sum_empty_set_non_reduced_axis_zero
        test_reduce_sum_square_empty_set test_reshape_allowzero_reordered
        test_split_zero_size_splits_opset13 test_split_zero_size_splits_opset18 test_tril_zero
        test_triu_zero"""),
    (DTYPE, """
        test_add_int16 test_add_int8 test_add_uint16 test_add_uint32 test_add_uint64 test_add_uint8
        test_bitwise_and_i16_3d test_bitwise_and_ui64_bcast_3v1d test_bitwise_and_ui8_bcast_4v3d
        test_bitwise_not_3d test_bitwise_not_4d test_bitwise_or_i16_4d test_bitwise_or_ui64_bcast_3v1d
        test_bitwise_or_ui8_bcast_4v3d test_bitwise_xor_i16_3d test_bitwise_xor_ui64_bcast_3v1d
        test_bitwise_xor_ui8_bcast_4v3d test_cast_DOUBLE_to_FLOAT test_cast_DOUBLE_to_FLOAT16
        test_cast_FLOAT16_to_DOUBLE test_cast_FLOAT16_to_FLOAT4E2M1 test_cast_FLOAT16_to_FLOAT8E4M3FN
        test_cast_FLOAT16_to_FLOAT8E4M3FNUZ test_cast_FLOAT16_to_FLOAT8E5M2
        test_cast_FLOAT16_to_FLOAT8E5M2FNUZ test_cast_FLOAT16_to_INT2 test_cast_FLOAT16_to_INT4
        test_cast_FLOAT16_to_UINT2 test_cast_FLOAT16_to_UINT4 test_cast_FLOAT4E2M1_to_FLOAT
        test_cast_FLOAT4E2M1_to_FLOAT16 test_cast_FLOAT8E4M3FNUZ_to_FLOAT
        test_cast_FLOAT8E4M3FNUZ_to_FLOAT16 test_cast_FLOAT8E4M3FN_to_FLOAT
        test_cast_FLOAT8E4M3FN_to_FLOAT16 test_cast_FLOAT8E5M2FNUZ_to_FLOAT
        test_cast_FLOAT8E5M2FNUZ_to_FLOAT16 test_cast_FLOAT8E5M2_to_FLOAT
        test_cast_FLOAT8E5M2_to_FLOAT16 test_cast_FLOAT_to_DOUBLE test_cast_FLOAT_to_FLOAT4E2M1
        test_cast_FLOAT_to_FLOAT8E4M3FN test_cast_FLOAT_to_FLOAT8E4M3FNUZ test_cast_FLOAT_to_FLOAT8E5M2
        test_cast_FLOAT_to_FLOAT8E5M2FNUZ test_cast_FLOAT_to_INT2 test_cast_FLOAT_to_INT4
        test_cast_FLOAT_to_UINT2 test_cast_FLOAT_to_UINT4 test_cast_INT2_to_FLOAT
        test_cast_INT2_to_FLOAT16 test_cast_INT2_to_INT8 test_cast_INT4_to_FLOAT
        test_cast_INT4_to_FLOAT16 test_cast_INT4_to_INT8 test_cast_UINT2_to_FLOAT
        test_cast_UINT2_to_FLOAT16 test_cast_UINT2_to_UINT8 test_cast_UINT4_to_FLOAT
        test_cast_UINT4_to_FLOAT16 test_cast_UINT4_to_UINT8 test_cast_e8m0_FLOAT16_to_FLOAT8E8M0
        test_cast_e8m0_FLOAT8E8M0_to_FLOAT test_cast_e8m0_FLOAT8E8M0_to_FLOAT16
        test_cast_e8m0_FLOAT_to_FLOAT8E8M0 test_cast_no_saturate_FLOAT16_to_FLOAT8E4M3FN
        test_cast_no_saturate_FLOAT16_to_FLOAT8E4M3FNUZ test_cast_no_saturate_FLOAT16_to_FLOAT8E5M2
        test_cast_no_saturate_FLOAT16_to_FLOAT8E5M2FNUZ test_cast_no_saturate_FLOAT_to_FLOAT8E4M3FN
        test_cast_no_saturate_FLOAT_to_FLOAT8E4M3FNUZ test_cast_no_saturate_FLOAT_to_FLOAT8E5M2
        test_cast_no_saturate_FLOAT_to_FLOAT8E5M2FNUZ test_castlike_DOUBLE_to_FLOAT
        test_castlike_DOUBLE_to_FLOAT16 test_castlike_FLOAT16_to_DOUBLE
        test_castlike_FLOAT16_to_FLOAT4E2M1 test_castlike_FLOAT16_to_FLOAT8E4M3FN
        test_castlike_FLOAT16_to_FLOAT8E4M3FNUZ test_castlike_FLOAT16_to_FLOAT8E5M2
        test_castlike_FLOAT16_to_FLOAT8E5M2FNUZ test_castlike_FLOAT16_to_INT2
        test_castlike_FLOAT16_to_INT4 test_castlike_FLOAT16_to_UINT2 test_castlike_FLOAT16_to_UINT4
        test_castlike_FLOAT4E2M1_to_FLOAT test_castlike_FLOAT4E2M1_to_FLOAT16
        test_castlike_FLOAT8E4M3FNUZ_to_FLOAT test_castlike_FLOAT8E4M3FNUZ_to_FLOAT16
        test_castlike_FLOAT8E4M3FN_to_FLOAT test_castlike_FLOAT8E4M3FN_to_FLOAT16
        test_castlike_FLOAT8E5M2FNUZ_to_FLOAT test_castlike_FLOAT8E5M2FNUZ_to_FLOAT16
        test_castlike_FLOAT8E5M2_to_FLOAT test_castlike_FLOAT8E5M2_to_FLOAT16
        test_castlike_FLOAT_to_DOUBLE test_castlike_FLOAT_to_FLOAT4E2M1
        test_castlike_FLOAT_to_FLOAT8E4M3FN test_castlike_FLOAT_to_FLOAT8E4M3FNUZ
        test_castlike_FLOAT_to_FLOAT8E5M2 test_castlike_FLOAT_to_FLOAT8E5M2FNUZ
        test_castlike_FLOAT_to_INT2 test_castlike_FLOAT_to_INT4 test_castlike_FLOAT_to_UINT2
        test_castlike_FLOAT_to_UINT4 test_castlike_INT2_to_FLOAT test_castlike_INT2_to_FLOAT16
        test_castlike_INT2_to_INT8 test_castlike_INT4_to_FLOAT test_castlike_INT4_to_FLOAT16
        test_castlike_INT4_to_INT8 test_castlike_UINT2_to_FLOAT test_castlike_UINT2_to_FLOAT16
        test_castlike_UINT2_to_UINT8 test_castlike_UINT4_to_FLOAT test_castlike_UINT4_to_FLOAT16
        test_castlike_UINT4_to_UINT8 test_castlike_no_saturate_FLOAT16_to_FLOAT8E4M3FN
        test_castlike_no_saturate_FLOAT16_to_FLOAT8E4M3FNUZ
        test_castlike_no_saturate_FLOAT16_to_FLOAT8E5M2
        test_castlike_no_saturate_FLOAT16_to_FLOAT8E5M2FNUZ
        test_castlike_no_saturate_FLOAT_to_FLOAT8E4M3FN
        test_castlike_no_saturate_FLOAT_to_FLOAT8E4M3FNUZ test_castlike_no_saturate_FLOAT_to_FLOAT8E5M2
        test_castlike_no_saturate_FLOAT_to_FLOAT8E5M2FNUZ test_clip_default_int8_inbounds
        test_clip_default_int8_inbounds_expanded test_clip_default_int8_max test_clip_default_int8_min
        test_div_int16 test_div_int8 test_div_uint16 test_div_uint32 test_div_uint64 test_div_uint8
        test_equal_int16 test_equal_int8 test_equal_string test_equal_string_broadcast test_equal_uint16
        test_equal_uint32 test_equal_uint64 test_equal_uint8 test_eyelike_with_dtype
        test_greater_equal_int16 test_greater_equal_int8 test_greater_equal_uint16
        test_greater_equal_uint32 test_greater_equal_uint64 test_greater_equal_uint8 test_greater_int16
        test_greater_int8 test_greater_uint16 test_greater_uint32 test_greater_uint64 test_greater_uint8
        test_less_equal_int16 test_less_equal_int8 test_less_equal_uint16 test_less_equal_uint32
        test_less_equal_uint64 test_less_equal_uint8 test_less_int16 test_less_int8 test_less_uint16
        test_less_uint32 test_less_uint64 test_less_uint8 test_max_float64 test_max_int16 test_max_int8
        test_max_uint16 test_max_uint32 test_max_uint64 test_max_uint8 test_maxpool_2d_uint8
        test_min_float64 test_min_int16 test_min_int8 test_min_uint16 test_min_uint32 test_min_uint64
        test_min_uint8 test_mod_float64_mixed_sign_fmod_0 test_mod_float_edge_cases_fmod_0_float64
        test_mod_mixed_sign_float64 test_mod_mixed_sign_int16 test_mod_mixed_sign_int8 test_mod_uint16
        test_mod_uint32 test_mod_uint64 test_mod_uint8 test_mul_int16 test_mul_int8 test_mul_uint16
        test_mul_uint32 test_mul_uint64 test_mul_uint8 test_pow_types_float32_uint32
        test_pow_types_float32_uint64 test_reduce_log_sum_exp_default_axes_keepdims_example
        test_reduce_log_sum_exp_default_axes_keepdims_random
        test_reduce_log_sum_exp_do_not_keepdims_example test_reduce_log_sum_exp_do_not_keepdims_random
        test_reduce_log_sum_exp_keepdims_example test_reduce_log_sum_exp_keepdims_random
        test_reduce_log_sum_exp_negative_axes_keepdims_example
        test_reduce_log_sum_exp_negative_axes_keepdims_random test_sub_int16 test_sub_int8
        test_sub_uint16 test_sub_uint32 test_sub_uint64 test_sub_uint8"""),
    (MVN_DEFAULT_AXES, """
        test_mvn"""),
    (NOT_TENSOR, """
        test_identity_opt test_identity_sequence"""),
    (OUTER_AXES, """
        test_argmax_default_axis_example test_argmax_default_axis_example_select_last_index
        test_argmax_default_axis_random test_argmax_default_axis_random_select_last_index
        test_argmax_keepdims_random test_argmax_keepdims_random_select_last_index
        test_argmax_no_keepdims_random test_argmax_no_keepdims_random_select_last_index
        test_argmin_default_axis_example test_argmin_default_axis_example_select_last_index
        test_argmin_default_axis_random test_argmin_default_axis_random_select_last_index
        test_argmin_keepdims_random test_argmin_keepdims_random_select_last_index
        test_argmin_no_keepdims_random test_argmin_no_keepdims_random_select_last_index test_hardmax_axis_0
        test_hardmax_axis_1 test_l2normalization_axis_0 test_logsoftmax_axis_0 test_logsoftmax_axis_1
        test_reduce_log_sum_asc_axes test_reduce_log_sum_negative_axes test_reduce_max_do_not_keepdims_example
        test_reduce_max_do_not_keepdims_random test_reduce_max_keepdims_example
        test_reduce_max_keepdims_random test_reduce_max_negative_axes_keepdims_example
        test_reduce_max_negative_axes_keepdims_random test_reduce_mean_do_not_keepdims_example
        test_reduce_mean_do_not_keepdims_random test_reduce_mean_keepdims_example
        test_reduce_mean_keepdims_random test_reduce_mean_negative_axes_keepdims_example
        test_reduce_mean_negative_axes_keepdims_random test_reduce_min_do_not_keepdims_example
        test_reduce_min_do_not_keepdims_random test_reduce_min_keepdims_example
        test_reduce_min_keepdims_random test_reduce_min_negative_axes_keepdims_example
        test_reduce_min_negative_axes_keepdims_random test_reduce_sum_do_not_keepdims_example
        test_reduce_sum_do_not_keepdims_random test_reduce_sum_keepdims_example
        test_reduce_sum_keepdims_random test_reduce_sum_negative_axes_keepdims_example
        test_reduce_sum_negative_axes_keepdims_random test_reduce_sum_square_do_not_keepdims_example
        test_reduce_sum_square_do_not_keepdims_random test_reduce_sum_square_keepdims_example
        test_reduce_sum_square_keepdims_random test_reduce_sum_square_negative_axes_keepdims_example
        test_reduce_sum_square_negative_axes_keepdims_random test_softmax_axis_0 test_softmax_axis_1"""),
    (TRAINING, """
        test_batchnorm_epsilon_training_mode test_batchnorm_example_training_mode test_training_dropout_zero_ratio
        test_training_dropout_zero_ratio_mask"""),
    (RANDOM_DROPOUT, """
        test_training_dropout test_training_dropout_default test_training_dropout_default_mask
        test_training_dropout_mask"""),
    (RESIZE_MODE, """
        test_resize_downsample_scales_cubic test_resize_downsample_scales_cubic_A_n0p5_exclude_outside
        test_resize_downsample_scales_cubic_align_corners test_resize_downsample_scales_cubic_antialias
        test_resize_downsample_scales_linear_antialias test_resize_downsample_sizes_cubic
        test_resize_downsample_sizes_cubic_antialias test_resize_downsample_sizes_linear_antialias
        test_resize_tf_crop_and_resize test_resize_tf_crop_and_resize_axes_2_3
        test_resize_tf_crop_and_resize_axes_3_2 test_resize_tf_crop_and_resize_extrapolation_value
        test_resize_upsample_scales_cubic test_resize_upsample_scales_cubic_A_n0p5_exclude_outside
        test_resize_upsample_scales_cubic_align_corners test_resize_upsample_scales_cubic_asymmetric
        test_resize_upsample_sizes_cubic"""),
    (POOL_NOT_2D, """
        test_averagepool_1d_default test_averagepool_3d_default
        test_averagepool_3d_dilations_large_count_include_pad_is_0_ceil_mode_is_False
        test_averagepool_3d_dilations_large_count_include_pad_is_0_ceil_mode_is_True
        test_averagepool_3d_dilations_large_count_include_pad_is_1_ceil_mode_is_False
        test_averagepool_3d_dilations_large_count_include_pad_is_1_ceil_mode_is_True
        test_averagepool_3d_dilations_small test_maxpool_1d_default test_maxpool_3d_default
        test_maxpool_3d_dilations test_maxpool_3d_dilations_use_ref_impl test_maxpool_3d_dilations_use_ref_impl_large
    """),
    (POOL_INDICES, """
        test_maxpool_with_argmax_2d_precomputed_pads test_maxpool_with_argmax_2d_precomputed_strides
    """),
    (POOL_AVERAGE_DILATED, """
        test_averagepool_2d_dilations
    """),
    (CONVT_SAME, """
        test_convtranspose_autopad_same"""),
)
KNOWN_UNSUPPORTED: dict[str, Unsupported] = {name: why for why, names in _LISTED for name in names.split()}
LISTED_WITH_ONNX = (1, 23)  # an older onnx lacks some listed cases (int2, float4, ...)

TOLERANCE = 1e-4  # |a - b| <= TOLERANCE * max(1, max|ref|), as tests/backends/test_codegen_cpu.py


@dataclass(frozen=True)
class NodeCase:
    name: str
    model: onnx.ModelProto
    data_sets: tuple[tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]], ...]

    @property
    def op(self) -> str:
        return self.model.graph.node[0].op_type


# -- discovery --------------------------------------------------------------------------------

def _is_covered(model: onnx.ModelProto) -> bool:
    nodes = model.graph.node
    return len(nodes) == 1 and nodes[0].domain in ("", "ai.onnx") and nodes[0].op_type in COVERED_OPS


def _read_tensor(path: Path) -> np.ndarray:
    tensor = onnx.TensorProto()
    tensor.ParseFromString(path.read_bytes())
    return numpy_helper.to_array(tensor)


def _cases_on_disk() -> list[NodeCase]:
    cases = []
    for folder in sorted(DATA_DIR.glob("test_*")):
        model = onnx.load(str(folder / "model.onnx"))
        if not _is_covered(model):
            continue
        sets = tuple((tuple(_read_tensor(p) for p in sorted(d.glob("input_*.pb"), key=_pb_index)),
                      tuple(_read_tensor(p) for p in sorted(d.glob("output_*.pb"), key=_pb_index)))
                     for d in sorted(folder.glob("test_data_set_*")))
        cases.append(NodeCase(folder.name, model, sets))
    return cases


def _pb_index(path: Path) -> int:
    return int(path.stem.rsplit("_", 1)[1])


def _as_array(x) -> np.ndarray:
    return numpy_helper.to_array(x) if isinstance(x, onnx.TensorProto) else np.asarray(x)


def _cases_generated() -> list[NodeCase]:
    from onnx.backend.test.case import node

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        generated = node.collect_testcases()
    return [NodeCase(c.name, c.model, tuple((tuple(map(_as_array, i)), tuple(map(_as_array, o)))
                                            for i, o in c.data_sets))
            for c in generated if c.kind == "node" and _is_covered(c.model)]


@cache
def node_cases() -> tuple[NodeCase, ...]:
    cases = _cases_on_disk() if DATA_DIR.is_dir() else _cases_generated()
    return tuple(sorted(cases, key=lambda c: c.name))


# -- one case ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    status: str  # "passed" | "refused" | "failed"
    detail: str = ""


class Refused(Exception):
    """The case cannot run as a one-node generated kernel; the message says why."""


def _check_inputs(model: onnx.ModelProto) -> None:
    """Static tensor inputs only (what `prepare` accepts without --input-shape); a zero-size one
    goes to the loader, which decides."""
    for vi in model.graph.input:
        dims = vi.type.tensor_type.shape.dim
        if not vi.type.HasField("tensor_type") or any(not d.HasField("dim_value") for d in dims):
            raise Refused(f"input '{vi.name}' is dynamic (not a tensor of static shape)")


def _loadable(model: onnx.ModelProto) -> onnx.ModelProto:
    """Models older than the loader's minimum opset, upgraded by onnx's version converter."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), TARGET_OPSET)
    if opset >= MIN_OPSET:
        return model
    try:
        return onnx.version_converter.convert_version(model, TARGET_OPSET)
    except Exception as exc:  # the converter raises bare RuntimeError/ConvertError
        raise Refused(f"opset {opset} is below the loader's {MIN_OPSET} and does not convert: {exc}") from None


def _with_parameters_constant(case: NodeCase, inputs: tuple[np.ndarray, ...]) -> tuple[onnx.ModelProto, dict]:
    """The case's model with its parameter inputs as initializers, and the feeds for the rest."""
    model = onnx.ModelProto()
    model.CopyFrom(_loadable(case.model))
    graph, node = model.graph, model.graph.node[0]
    wanted = {node.input[k] for k in PARAMETER_INPUTS.get(node.op_type, ()) if k < len(node.input)} - {""}
    values = dict(zip([vi.name for vi in graph.input], inputs, strict=True))
    feeds, keep = {}, []
    for vi in graph.input:
        if vi.name in wanted:
            graph.initializer.append(numpy_helper.from_array(values[vi.name], vi.name))
        else:
            keep.append(vi)
            feeds[vi.name] = values[vi.name]
    del graph.input[:]
    graph.input.extend(keep)
    _check_inputs(model)
    return model, feeds


def _check_graph(prep) -> None:
    graph = prep.graph
    if len(graph.nodes) == 0:
        raise Refused("folded to a constant")
    if len(graph.nodes) != 1:
        raise Refused(f"canonicalized to {len(graph.nodes)} nodes, not one")
    node = graph.nodes[0]
    for t in (x for x in node.inputs + node.outputs if x):
        info = graph.tensors[t]
        if info.shape is None:
            raise Refused(f"dynamic shape of '{t}'")
        if info.dtype not in CTYPES:
            raise Refused(f"dtype {info.dtype} has no C type in the generator")
    if node.kind.name == "REDUCE":
        rows = reduced_rows(graph, node)
        if not isinstance(rows, tuple):
            raise Refused(f"not supported yet: {rows.reason}")


def _compare(name: str, got: np.ndarray, ref: np.ndarray) -> None:
    """Exact for integers and bools; floats within TOLERANCE, NaN and infinities where expected."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        raise AssertionError(f"{name}: {got.dtype}{got.shape}, expected {ref.dtype}{ref.shape}")
    if ref.dtype.kind in "biu":
        np.testing.assert_array_equal(got, ref, err_msg=name)
        return
    a, b = got.astype(np.float64), ref.astype(np.float64)
    nan = np.isnan(b)
    np.testing.assert_array_equal(np.isnan(a), nan, err_msg=f"{name}: NaN positions differ")
    same = (a == b) | nan
    err = np.where(same, 0.0, np.abs(a - b))
    finite = b[np.isfinite(b)]
    scale = max(1.0, float(np.max(np.abs(finite)))) if finite.size else 1.0
    if not np.all(err <= TOLERANCE * scale):
        worst = int(np.nanargmax(err))
        raise AssertionError(f"{name}: max error {err.flat[worst]:.3g} at {worst} (got {a.flat[worst]!r}, "
                             f"expected {b.flat[worst]!r}, tolerance {TOLERANCE * scale:.3g})")


def _run_data_set(case: NodeCase, inputs, outputs, folder: Path) -> None:
    model, feeds = _with_parameters_constant(case, inputs)
    path = folder / f"{case.name}.onnx"
    path.write_bytes(model.SerializeToString())
    try:
        prep = prepare(str(path))
    except BadInput as exc:  # the loader's one-line refusal of the model (bad input)
        raise Refused(f"the loader refuses the model: {exc}") from None
    _check_graph(prep)
    kernel = try_lower(prep.graph, FusionGroup(frozenset({prep.graph.nodes[0].id})), host=True)  # as the CPU runs it
    if kernel.template == "opaque":
        refused = _lower_checked(prep.graph, list(prep.graph.nodes))
        raise Refused(f"not supported yet: lowered as a library call ({refused.reason})")
    try:
        gk = generate(prep.graph, kernel)
    except CodegenRefused as exc:
        raise Refused(f"generator refuses: {exc.decision.reason}") from None
    got = cpu.run(gk, _kernel_inputs(prep, gk, feeds))
    names = [vi.name for vi in case.model.graph.output]
    for name, ref in zip(names, outputs, strict=True):
        _compare(name, got[name], ref)


def _kernel_inputs(prep, gk, feeds: dict) -> dict:
    """The kernel's inputs: the case's feeds and the graph's constants; ONNX Runtime only when some
    input is computed (it does not load the newest IR versions some cases are written in)."""
    got = {a.tensor: feeds[a.tensor] if a.tensor in feeds else prep.graph.constant_value(a.tensor)
           for a in gk.inputs}
    if any(v is None for v in got.values()):
        values = all_values(to_proto(prep.canonical), feeds)
        got = {a.tensor: values[a.tensor] for a in gk.inputs}
    return got


@cache
def outcome(name: str) -> Outcome:
    case = next(c for c in node_cases() if c.name == name)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for inputs, outputs in case.data_sets:
                _run_data_set(case, inputs, outputs, Path(tmp))
    except Refused as exc:
        return Outcome("refused", str(exc))
    except Exception as exc:  # a crash or a wrong value: reported by the case's test
        return Outcome("failed", f"{type(exc).__name__}: {exc}")
    return Outcome("passed")


# -- tests ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [c.name for c in node_cases()])
def test_node_case(name):
    result, known = outcome(name), KNOWN_UNSUPPORTED.get(name)
    if known is None:
        assert result.status == "passed", (
            f"{name} {result.status}: {result.detail}" + ("; fix it, or list it in KNOWN_UNSUPPORTED with the "
                                                         "reason if it is outside the generator's scope"
                                                         if result.status == "refused" else ""))
        return
    assert result.status != "passed", f"{name} runs now: remove it from KNOWN_UNSUPPORTED"
    assert result.status == "refused", f"{name} (listed: {known.reason}) {result.status}: {result.detail}"
    assert re.search(known.refusal, result.detail), (
        f"{name} is listed as '{known.reason}' but is refused for another reason: {result.detail}; "
        "update its KNOWN_UNSUPPORTED entry")
    pytest.skip(f"known unsupported: {known.reason}")


def test_known_unsupported_names_only_cases_that_exist():
    names = {c.name for c in node_cases()}
    stale = sorted(set(KNOWN_UNSUPPORTED) - names)
    if stale and tuple(int(x) for x in onnx.__version__.split(".")[:2]) < LISTED_WITH_ONNX:
        pytest.skip(f"onnx {onnx.__version__} predates the list's cases ({len(stale)} listed cases absent)")
    assert not stale, f"no such node case (remove from KNOWN_UNSUPPORTED): {', '.join(stale)}"


def test_summary():
    cases = node_cases()
    ops = sorted({c.op for c in cases})
    results = {c.name: outcome(c.name) for c in cases}
    counts: dict[str, Counter] = defaultdict(Counter)
    for c in cases:
        counts[c.op][results[c.name].status] += 1
    print(f"\ncovered ops ({len(ops)}): {', '.join(ops)}")
    for op in ops:
        print(f"  {op:20s} " + " ".join(f"{k}={v}" for k, v in sorted(counts[op].items())))
    for status in ("refused", "failed"):
        print(f"{status} cases:")
        for c in cases:
            if results[c.name].status == status:
                listed = " (known unsupported)" if c.name in KNOWN_UNSUPPORTED else ""
                print(f"  {c.name}{listed}: {results[c.name].detail}")
    assert ops, "no ONNX node test case for any op the generator lowers"
    expected = COVERED_OPS - WITHOUT_NODE_CASES
    assert set(ops) == expected, f"ops without a node test case: {sorted(expected - set(ops))}"
