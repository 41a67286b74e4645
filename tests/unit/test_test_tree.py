"""The test tree itself: pytest's default (rootdir-less) import mode needs unique basenames.

Two test files called the same in tests/unit and tests/integration collect fine one
directory at a time and fail `make test` at collection ("import file mismatch").
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique() -> None:
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []
