"""The small model family the demo, the benchmarks and the tests run on (see ``family/README.md``, its model card).

* :func:`load_family` / :class:`Family`: the shipped family (or ``$SPECDEC_ZOO``, or a path), with
  ``make_drafter(name)`` for ``"ngram"``, ``"draft-model"``, ``"medusa"``, ``"eagle1"``, ``"eagle2"``, ``"eagle3"``.
* :func:`build_zoo`: rebuild it from the Python standard library's source (``specdec zoo build``).
* :func:`heldout_texts`: held-out source files (never trained on) for prompts.
"""

from specdec_ext.zoo.corpus import heldout_texts
from specdec_ext.zoo.family import SHIPPED_DIR, Family, family_dir, load_family
from specdec_ext.drafters.shapes import DRAFTER_NAMES
from specdec_ext.zoo.spec import FULL, QUICK, ZooSpec


def build_zoo(*args, **kwargs):
    """See :func:`specdec_ext.zoo.build.build_zoo`."""
    from specdec_ext.zoo.build import build_zoo as _build

    return _build(*args, **kwargs)


__all__ = ["DRAFTER_NAMES", "FULL", "Family", "QUICK", "SHIPPED_DIR", "ZooSpec", "build_zoo", "family_dir",
           "heldout_texts", "load_family"]
