"""push_pull(average=True) scales before the sum: 30000 on 3 workers averages to 30000 (within
float16's precision, 1 part in 1024) over a float16 wire, where summing first gives inf (float16's
maximum is 65504). Real workers, gloo."""

import pytest
from multiworker import ok, run_workers

WORKERS = 3
FP16_PRECISION = 2**-10  # the sum of three float16 values is rounded to float16's 10-bit mantissa


@pytest.mark.timeout(90)
def test_torch_average_of_large_values_over_fp16_stays_finite():
    for result in ok(run_workers(WORKERS, "average_cases:torch_large_averages", timeout=80)):
        for key in ("fp16_wire", "fp16_wire_in_place", "half_tensor"):
            assert result[key] == pytest.approx([30000.0] * 4, rel=FP16_PRECISION), key
        assert result["int_average_truncates"] == [2]  # (1 + 2 + 3) // 3, summed first as before


@pytest.mark.timeout(300)
def test_tensorflow_average_of_large_values_over_fp16_stays_finite():
    pytest.importorskip("tensorflow")
    for result in ok(run_workers(WORKERS, "tf_average_cases:tf_large_averages", timeout=280)):
        assert set(result) == {"fp16_wire", "fp16_wire_in_graph", "half_tensor"}
        for key, values in result.items():
            assert values == pytest.approx([30000.0] * 4, rel=FP16_PRECISION), key
