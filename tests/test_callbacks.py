from poise_trl.core.metrics import calibration_bins


def test_calibration_bins_by_hand():
    records = [
        {"predictions": [0.05, 0.15, 0.12, 0.95], "targets": [0.0, 1.0, 0.0, 1.0]},
        {"predictions": [1.0, 0.18], "targets": [1.0, 1.0]},
    ]
    bins = calibration_bins(records, bins=10)
    assert [b["count"] for b in bins] == [1, 3, 2]
    assert bins[0] == {"mean_predicted": 0.05, "mean_realized": 0.0, "count": 1}
    assert abs(bins[1]["mean_predicted"] - (0.15 + 0.12 + 0.18) / 3) < 1e-12
    assert abs(bins[1]["mean_realized"] - 2 / 3) < 1e-12
    assert bins[2]["mean_realized"] == 1.0  # a prediction of exactly 1 falls in the top bin
