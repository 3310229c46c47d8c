"""docs/benchmarks.md's "what a part costs" and "measured and not kept" figures come from
`benchmarks/ab_group.py` over the variant files in `benchmarks/variants/`: each variant is a set of
edits of a group's C texts (its generated source, the shared C runtime's and its units'; the group
named by its nodes, or several groups), or a group generated afresh with schedule constants set
otherwise (CONSTANTS), so a generator change that moves the edited text would break those commands. Each file's group must still lower to one packed
kernel (in channel blocks where the file says LAYOUT = "nchwc") and every edit must still match."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VARIANT_FILES = sorted((ROOT / "benchmarks" / "variants").glob("*.py"))


def _ab_group():
    spec = importlib.util.spec_from_file_location("ab_group", ROOT / "benchmarks" / "ab_group.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


AB = _ab_group()


def test_there_are_variant_files():
    assert {p.stem for p in VARIANT_FILES} >= {"gelu_epilogue", "score_softmax", "micro_kernel"}


@pytest.mark.parametrize("path", VARIANT_FILES, ids=lambda p: p.stem)
def test_every_variant_still_edits_its_group(path):
    spec = AB.load_variants(path)
    layout = spec.get("LAYOUT", "nchw")
    for model, nodes in AB.groups(spec):
        _, kernel, base = AB.group_kernel(model, nodes, layout, lanes=8)  # a blocked form in AVX2's blocks of 8
        assert kernel.anchor is not None  # a fused product, as on the host: packed, or a depthwise conv's loop
        assert kernel.schedule.skeleton == ("depthwise" if kernel.template == "depthwise" else "packed")
        assert (kernel.schedule.product == "nchwc") == (layout == "nchwc")
        for label, edits in spec.get("VARIANTS", {}).items():
            sources = AB.edited(AB.texts(base), edits, label)
            assert sources != AB.texts(base), (model, nodes, label)
        for label, values in spec.get("CONSTANTS", {}).items():  # generated afresh: another kernel
            with AB.constants(values):
                assert AB.group_kernel(model, nodes, layout, lanes=8)[2].c_source != base.c_source, (model, label)
    assert set(spec.get("BOUNDS", ())) <= set(spec.get("VARIANTS", {})) | set(spec.get("CONSTANTS", {}))


def test_a_constants_variant_names_constants_the_schedule_has(tmp_path):
    """CONSTANTS sets `fusesearch.schedule`'s constants for a variant generated afresh: a name the
    schedule lacks is refused in one line, and the constants are restored after."""
    from fusesearch import schedule

    bad = tmp_path / "bad.py"
    bad.write_text('MODEL = "resnet18"\nNODES = ("conv_0",)\nCONSTANTS = {"x": {"NCHWC_NO_SUCH": 1}}\n')
    with pytest.raises(AB.VariantError, match="fusesearch.schedule has no constant NCHWC_NO_SUCH"):
        AB.load_variants(bad)
    before = schedule.NCHWC_RUN_PIXELS
    with AB.constants({"NCHWC_RUN_PIXELS": 1}):
        assert schedule.NCHWC_RUN_PIXELS == 1
    assert schedule.NCHWC_RUN_PIXELS == before


def test_an_edit_that_no_longer_matches_is_refused():
    with pytest.raises(AB.VariantError, match="the generator changed"):
        AB.edited(("int x;", "int y;"), [(r"fs_erff\(", "(")], "erf taken out")


def test_program_mode_takes_constants_variants_only():
    """`--program` generates the whole program under each variant: a file of text edits (which
    name one group's source) is refused in one line before anything is built."""
    spec = AB.load_variants(ROOT / "benchmarks" / "variants" / "gelu_epilogue.py")
    with pytest.raises(AB.VariantError, match="--program times CONSTANTS variants only"):
        AB.run_program(spec, *AB.groups(spec)[0], None)
