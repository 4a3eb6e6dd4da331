"""Every numeric option of dew.sampling's samplers, schedules and ``Sampling`` takes
a numpy scalar or a 0-d array as it takes the Python number (issue 42: numbers in
every numeric form)."""

import dataclasses

import numpy as np
import pytest

import dew.sampling as sampling

# the option records that build from their defaults alone (pipelines need a model)
RECORDS = sorted(
    name
    for name in dir(sampling)
    if isinstance(getattr(sampling, name), type)
    and dataclasses.is_dataclass(getattr(sampling, name))
    and all(
        f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        for f in dataclasses.fields(getattr(sampling, name))
        if f.init
    )
)


def test_the_records_cover_every_sampler_and_schedule():
    samplers = {"DDIM", "DDPM", "EDMHeun", "FlowEuler", "FlowHeun", "FlowSDE", "MaskedSampler"}
    expected = samplers | {
        "Sampling",
        "DDPMSchedule",
        "EDMSchedule",
        "FlowSchedule",
        "MaskSchedule",
    }
    assert expected <= set(RECORDS), expected - set(RECORDS)


@pytest.mark.parametrize("name", RECORDS)
def test_every_numeric_option_accepts_numpy_scalars_and_0d_arrays(name):
    record = getattr(sampling, name)()
    checked = 0
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if not field.init or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        forms = (np.int64, np.int32, np.array) if isinstance(value, int) else (
            np.float32, np.float64, np.array)  # fmt: skip
        for form in forms:
            again = dataclasses.replace(record, **{field.name: form(value)})
            assert float(getattr(again, field.name)) == pytest.approx(float(value), rel=1e-6)
        checked += 1
    assert checked > 0, name
