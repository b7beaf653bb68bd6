"""experiments/goodput: the calibration reproduces FailureModel's defaults, the grid's table."""

import pytest

from diloco.sim import analytic, params
from experiments.goodput import calibrate, heterogeneous, table


def test_failure_model_defaults_are_the_calibration_fit():
  """The defaults are what calibrate.fit returns from a start away from them."""
  start = params.FailureModel(restart_s=30.0, reconfig_s=30.0, repair_s=3600.0)
  fitted = calibrate.fit(start)
  default = params.FailureModel()
  for name in calibrate.FITTED:
    assert getattr(fitted, name) == pytest.approx(getattr(default, name), rel=0.01), name


def test_the_fit_is_close_to_the_paper_numbers():
  fm = params.FailureModel()
  for mode in ("dp", "elastic"):
    for chips, paper in zip(calibrate.CHIPS, calibrate.PAPER[mode]):
      assert 100 * analytic.goodput(mode, chips, fm) == pytest.approx(paper, abs=3.5)


def test_table_marks_paper_values_where_known():
  grid = {row: [0.5] * len(table.CHIPS) for row in table.ROWS}
  text = table.markdown(grid)
  lines = text.splitlines()
  assert lines[0] == "| goodput % | 150k | 300k | 600k | 1.2M | 2.4M |"
  assert "| data-parallel | 50.0 (72) | 50.0 (57) |" in text
  assert "| Decoupled M=8 | 50.0 | 50.0 | 50.0 | 50.0 (88) | 50.0 |" in text
  assert "| Decoupled M=16 | 50.0 | 50.0 | 50.0 | 50.0 | 50.0 |" in text


def test_heterogeneous_policies():
  assert heterogeneous.policies(8) == [("K=M=8", 8, False), ("K=1, no grace", 1, False),
                                       ("K=1, grace", 1, True)]
