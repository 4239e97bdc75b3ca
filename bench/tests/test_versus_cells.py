"""`--cells`: a partial side-by-side over named cells of the full grid."""
import pytest

from pdserve.bench.versus import protocol
from pdserve.bench.versus.run import parse, pick_cells


def test_no_cells_named_gives_the_modes_grid():
    assert pick_cells("quick", "") == protocol.cells("quick")
    assert pick_cells("full", "") == protocol.cells("full")


def test_named_cells_come_from_the_full_grid_in_its_order():
    got = pick_cells("part", " 1024x16,128x1 ")
    assert [c.key for c in got] == ["128x1", "1024x16"]


def test_a_cell_outside_the_grid_is_refused_naming_it():
    with pytest.raises(SystemExit, match="999x1"):
        pick_cells("part", "128x1,999x1")


def test_cells_and_quick_together_are_refused():
    with pytest.raises(SystemExit):
        parse(["--quick", "--cells", "128x1"])
