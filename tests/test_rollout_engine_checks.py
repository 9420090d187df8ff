"""An `Engine` built from the library (where no config check runs) refuses sizes it could run nothing with (issue
#55, round 3): with `num_slots=0` the episode runner used to wait forever on a semaphore of 0. Refused in
`Engine.__init__`, before the sampler or any device memory."""
from __future__ import annotations

import pytest

from mercury_jax.rollout.engine import Engine


@pytest.mark.parametrize("field, value", [("num_slots", 0), ("num_slots", -1), ("num_slots", 2.0),
                                          ("num_slots", True), ("max_length", 0), ("steps_per_sync", 0)])
def test_an_engine_that_could_run_nothing_is_refused_where_it_is_built(field, value):
    sizes = {"num_slots": 2, "max_length": 16, "steps_per_sync": 1, field: value}
    with pytest.raises(ValueError) as refused:
        Engine(None, **sizes)  # no model needed: refused before the sampler is built
    message = str(refused.value)
    assert message.startswith(f"Engine {field}={value!r}: use a whole number >= 1"), message
    if field == "num_slots":
        assert message.endswith("with no slot it would run no request, and an episode runner would wait forever "
                                "for one")
