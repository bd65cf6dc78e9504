"""One list of packages: an evaluation's `versions` names those of `RESULTS_PACKAGES`, a subset of `PACKAGES`
(provenance.json's), under the keys and with the values the results JSON has always had."""

from __future__ import annotations

import sys

import torch
import transformers

import eagle3_zoo
from eagle3_zoo.util.provenance import PACKAGES, RESULTS_PACKAGES, versions


def test_results_versions_come_from_the_one_package_list():
    assert set(RESULTS_PACKAGES) <= set(PACKAGES)
    found = versions()
    assert list(found) == ["eagle3_zoo", "torch", "transformers", "python", "git"]  # the results JSON's keys
    assert [found[k] for k in ("eagle3_zoo", "torch", "transformers", "python")] == [
        eagle3_zoo.__version__, torch.__version__, transformers.__version__, sys.version.split()[0]]
    assert found["git"] is None or set(found["git"]) == {"sha", "dirty"}
