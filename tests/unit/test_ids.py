"""Run ids (crag.ids.check_run_id): what a user may name a run, and what is refused."""

import pytest

from crag.errors import InputError
from crag.ids import check_run_id


@pytest.mark.parametrize("run_id", ["r1\n", "r1\r\n", "r1\n\n", "\nr1", "r 1", "r1/..", "", "-r1", "r1\x00"])
def test_a_run_id_with_a_line_break_or_other_junk_is_refused(run_id):
    with pytest.raises(InputError, match="invalid run id"):
        check_run_id(run_id)


@pytest.mark.parametrize("run_id", ["r1", "base-2026.11.29_a", "A" * 128])
def test_good_run_ids_pass(run_id):
    assert check_run_id(run_id) == run_id
