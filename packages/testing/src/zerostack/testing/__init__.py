"""Dev-only test helpers for zerostack: never a runtime dependency of a package."""

from zerostack.testing.__about__ import __version__
from zerostack.testing._bad_inputs import (
    BadInput,
    check_bad_input,
    check_unique_ids,
    one_torch_thread,
    same_state,
)
from zerostack.testing._disk import drop_page_cache
from zerostack.testing._inner import inner_steps
from zerostack.testing._model import GPTConfig, TinyGPT, make_batch, num_parameters
from zerostack.testing._seeded import BufferedNet, LogRecords, reference_step, tensor_values
from zerostack.testing._spawn import SpawnError, spawn
from zerostack.testing._state_table import check_state_table
from zerostack.testing._tolerance import (
    assert_close,
    loss_tolerance,
    tolerance,
    training_tolerance,
)

__all__ = [
    "BadInput",
    "BufferedNet",
    "GPTConfig",
    "LogRecords",
    "SpawnError",
    "TinyGPT",
    "__version__",
    "assert_close",
    "check_bad_input",
    "check_state_table",
    "check_unique_ids",
    "drop_page_cache",
    "inner_steps",
    "loss_tolerance",
    "make_batch",
    "num_parameters",
    "one_torch_thread",
    "reference_step",
    "same_state",
    "spawn",
    "tensor_values",
    "tolerance",
    "training_tolerance",
]
