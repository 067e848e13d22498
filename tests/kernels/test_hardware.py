"""``hardware``: the SM count and compute capability come from the device (read once per
device), and per-device tables fall back to the reference device's entry (CPU; the device
half where CUDA is present)."""

from __future__ import annotations

import pytest
import torch

from dllm.runner.kernels import hardware


def test_no_cuda_device_gets_the_reference():
    for device in (None, "cpu", torch.device("cpu")):
        assert hardware.num_sms(device) == hardware.REFERENCE.num_sms
        assert hardware.capability(device) == hardware.REFERENCE.capability


def test_tuned_takes_the_entry_of_the_capability_else_the_reference():
    ref = hardware.REFERENCE.capability
    table = {ref: "reference", (1, 0): "other"}
    assert hardware.tuned(table, None) == "reference"
    assert hardware.tuned({ref: "reference"}, "cpu") == "reference"


@pytest.mark.gpu
def test_cuda_device_is_asked_once():
    dev = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    assert hardware.num_sms(dev) == props.multi_processor_count
    assert hardware.num_sms("cuda") == props.multi_processor_count
    assert hardware.capability(dev) == (props.major, props.minor)
    table = {hardware.REFERENCE.capability: "reference", (props.major, props.minor): "this"}
    assert hardware.tuned(table, dev) == "this"
    misses = hardware._properties.cache_info().misses
    hardware.num_sms(torch.device("cuda", dev.index))
    hardware.capability(str(dev))
    assert hardware._properties.cache_info().misses == misses  # the device was asked once
