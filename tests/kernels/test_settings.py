"""``KernelSettings``: the layer ops' environment knobs parse as switches, read once, and a
value that is not a switch is an error (CPU only, no Triton)."""

from __future__ import annotations

import dataclasses

import pytest

from dllm.runner.kernels.settings import KernelSettings, env_name


def test_defaults_when_unset_or_empty():
    assert KernelSettings.from_env({}) == KernelSettings(moe_grouped=True, fused_moe=True,
                                                         fuse_residual=True, fla_scan=True)
    assert KernelSettings.from_env({"DLLM_MOE_GROUPED": "", "DLLM_FUSE_RESIDUAL": " "}) == \
        KernelSettings()


@pytest.mark.parametrize("value", ["0", "false", "OFF", " no "])
def test_off_values(value):
    s = KernelSettings.from_env({"DLLM_MOE_GROUPED": value, "DLLM_FUSED_MOE": value,
                                 "DLLM_FUSE_RESIDUAL": value, "DLLM_FLA_SCAN": value})
    assert s == KernelSettings(moe_grouped=False, fused_moe=False, fuse_residual=False,
                               fla_scan=False)


@pytest.mark.parametrize("value", ["1", "true", "On", "yes"])
def test_on_values(value):
    assert KernelSettings.from_env({"DLLM_FUSE_RESIDUAL": value}).fuse_residual is True


@pytest.mark.parametrize("value", ["2", "banana", "0.0", "enabled"])
def test_bad_values_are_rejected(value):
    with pytest.raises(ValueError, match="DLLM_MOE_GROUPED"):
        KernelSettings.from_env({"DLLM_MOE_GROUPED": value})


def test_reads_os_environ_and_is_frozen(monkeypatch):
    monkeypatch.setenv("DLLM_FUSE_RESIDUAL", "0")
    monkeypatch.delenv("DLLM_MOE_GROUPED", raising=False)
    monkeypatch.delenv("DLLM_FUSED_MOE", raising=False)
    s = KernelSettings.from_env()
    assert s == KernelSettings(fuse_residual=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.fuse_residual = True  # type: ignore[misc]


def test_every_field_has_its_variable():
    assert [env_name(f.name) for f in dataclasses.fields(KernelSettings)] == \
        ["DLLM_MOE_GROUPED", "DLLM_FUSED_MOE", "DLLM_FUSE_RESIDUAL", "DLLM_FLA_SCAN"]
