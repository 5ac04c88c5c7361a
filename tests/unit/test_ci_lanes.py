"""The lanes of ``scripts/test.sh`` together run every test: the mcore lane collects ``tests/mcore`` only
(``-m mcore``) and the other lanes leave that folder out, so a megatron-core test outside it, or a test
file inside it without the ``mcore`` mark, would run in no lane."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
MARK = re.compile(r"pytest\.mark\.mcore\b")


def test_mcore_marked_tests_live_in_tests_mcore_and_every_file_there_is_marked() -> None:
    outside = sorted(
        str(p.relative_to(TESTS))
        for p in TESTS.rglob("*.py")
        if TESTS / "mcore" not in p.parents and p.name != Path(__file__).name and MARK.search(p.read_text())
    )
    assert outside == [], f"mcore-marked tests outside tests/mcore (move them there): {outside}"
    unmarked = sorted(p.name for p in (TESTS / "mcore").rglob("test_*.py") if not MARK.search(p.read_text()))
    assert unmarked == [], f"test files in tests/mcore without pytestmark = pytest.mark.mcore: {unmarked}"
