"""The library's drafter shapes (``specdec_ext.drafters.shapes``): one table that the family, the end-of-training
report, ``EagleDrafter.from_pretrained`` and the command line's drafter flags all decode with on a CPU, and the
drafters' own (published) defaults elsewhere; shapes given explicitly always win."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("transformers")

from test_drafter_eagle import random_draft, target  # noqa: E402

from specdec_ext.drafter_args import add_drafter_arguments, drafter_from_args  # noqa: E402
from specdec_ext.drafters import EagleDrafter  # noqa: E402
from specdec_ext.drafters.shapes import CPU_SHAPES, DRAFTER_NAMES, drafter_shape, eagle_tree_shape  # noqa: E402
from specdec_ext.models.checkpoints import save_eagle, save_medusa  # noqa: E402
from specdec_ext.models.medusa import MedusaHeads  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_table_by_device():
    assert set(CPU_SHAPES) == set(DRAFTER_NAMES)
    for name in DRAFTER_NAMES:
        got = drafter_shape(name, "cpu")
        assert got == CPU_SHAPES[name]
        got["extra"] = 1  # a copy: the caller may change it
        assert "extra" not in CPU_SHAPES[name]
    assert drafter_shape("eagle2", "cuda") == {} and drafter_shape("medusa", "cuda") == {}
    chain = drafter_shape("eagle1", "cuda")  # the EAGLE-1 chain stays a chain
    assert chain["top_k"] == 1 and chain["depth"] == chain["total_tokens"] == CPU_SHAPES["eagle1"]["depth"]
    assert eagle_tree_shape(1, "cpu") == {"depth": 6, "top_k": 2, "total_tokens": 8}  # (no file keys)
    assert eagle_tree_shape(3, "cpu")["depth"] == CPU_SHAPES["eagle3"]["depth"] and eagle_tree_shape(1, "cuda") == {}
    with pytest.raises(ValueError, match="unknown drafter 'lookahead'"):
        drafter_shape("lookahead", "cpu")


@pytest.mark.parametrize("version, name", [(1, "eagle2"), (3, "eagle3")])
def test_from_pretrained_takes_the_devices_tree_unless_given(tmp_path, version, name):
    save_eagle(random_draft(version), tmp_path / "d", base_model_name_or_path="tiny")
    shape = CPU_SHAPES[name]
    d = EagleDrafter.from_pretrained(tmp_path / "d", target=target())
    assert (d.depth, d.top_k, d.total_tokens) == (shape["depth"], shape["top_k"], shape["total_tokens"])
    d = EagleDrafter.from_pretrained(tmp_path / "d", target=target(), top_k=3)  # one given: the others the table's
    assert (d.depth, d.top_k, d.total_tokens) == (shape["depth"], 3, shape["total_tokens"])
    d = EagleDrafter.from_pretrained(tmp_path / "d", target=target(), depth=3, top_k=4, total_tokens=10)
    assert (d.depth, d.top_k, d.total_tokens, d.max_nodes) == (3, 4, 10, 11)


def cli_args(*argv) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_drafter_arguments(p)
    args = p.parse_args(list(argv))
    args.device, args.dtype, args.no_packed_linears = None, None, False
    return args


def test_cli_flags_default_to_the_table(tmp_path):
    m = target()
    save_eagle(random_draft(1), tmp_path / "e", base_model_name_or_path="tiny")
    d = drafter_from_args(cli_args("--eagle", str(tmp_path / "e")), m)
    assert (d.depth, d.top_k, d.total_tokens) == (6, 2, 8) == tuple(CPU_SHAPES["eagle2"][k] for k in
                                                                    ("depth", "top_k", "total_tokens"))
    d = drafter_from_args(cli_args("--eagle", str(tmp_path / "e"), "--eagle-total-tokens", "12"), m)
    assert (d.depth, d.top_k, d.total_tokens) == (6, 2, 12)
    H, V = m.config.hidden_size, m.config.vocab_size
    save_medusa(MedusaHeads(3, H, V).eval(), tmp_path / "m", base_model_name_or_path="tiny")
    d = drafter_from_args(cli_args("--medusa", str(tmp_path / "m")), m)
    assert d.dynamic and d.max_nodes == CPU_SHAPES["medusa"]["max_nodes"] == 10
    d = drafter_from_args(cli_args("--medusa", str(tmp_path / "m"), "--medusa-nodes", "6"), m)
    assert not d.dynamic and d.max_nodes == 6  # a flag given: the static tree it names, as before
