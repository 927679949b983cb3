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


@pytest.mark.timeout(150)
def test_a_step_compiled_with_xla_is_refused_naming_jit_compile_false():
    # XLA has no kernel for the engine call: TensorFlow's "Detected unsupported operations ...
    # EagerPyFunc" came at the first step, and Keras compiles model.fit with XLA by default
    # (jit_compile="auto") wherever a GPU is visible. Autograph shows an error raised while it
    # converts a user's tf.function as StagingError, the original's type and message in its text.
    (result,) = run_workers(1, "tf_input_cases:xla_compiled_steps", timeout=120)
    assert "ok" in result, result
    for key in ("tape", "fit", "push_pull"):
        message = result["ok"][key]
        assert message and "ConfigurationError: XLA" in message and "jit_compile=False" in message, (key, message)
    assert result["ok"]["after"] == [1.0, 1.0]
