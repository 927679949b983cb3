"""byteps.tensorflow refuses bad inputs with a clear error, and the job goes on (real worker)."""

import pytest
from multiworker import run_workers

pytest.importorskip("tensorflow")


@pytest.mark.timeout(150)
def test_unsupported_dtypes_raise_type_error_naming_the_tf_dtype():
    # A string tensor used to reach TensorFlow's DLPack export, which aborts the process (SIGABRT).
    (result,) = run_workers(1, "tf_input_cases:unsupported_dtypes", timeout=120)
    assert "ok" in result, result
    errors = result["ok"]["errors"]
    for dtype in ("string", "bool", "int16"):
        for key in (dtype, f"{dtype}.graph"):
            assert errors[key] and f"cannot sum {dtype} tensors" in errors[key], (key, errors[key])
            assert "torch" not in errors[key] and "float32" in errors[key]
    assert result["ok"]["after"] == [1.0, 1.0]


@pytest.mark.timeout(150)
def test_set_batch_sizes_takes_sequences_and_tensors_and_names_a_bad_argument():
    (result,) = run_workers(1, "tf_input_cases:set_batch_sizes_inputs", timeout=120)
    assert "ok" in result, result
    sizes = result["ok"]
    assert sizes["none"].startswith("InvalidAssignmentError") and "sequence" in sizes["none"] and "None" in sizes["none"]
    assert sizes["int"].startswith("InvalidAssignmentError") and "int 16" in sizes["int"]
    assert sizes["tensor"] == [12] and sizes["array"] == [10]
