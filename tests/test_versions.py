"""The supported torch releases: an untested one warns once at import, naming the range."""

import warnings

import pytest

from compile_shard import _versions


def test_an_untested_torch_warns_naming_the_tested_range(monkeypatch):
    monkeypatch.setattr(_versions, "TORCH_VERSION", (2, 11))
    with pytest.warns(_versions.UntestedTorchWarning, match=r"tested with torch 2\.13 to 2\.15; this is torch"):
        _versions.warn_if_untested()


@pytest.mark.parametrize("version", _versions.SUPPORTED)
def test_a_tested_torch_does_not_warn(monkeypatch, version):
    monkeypatch.setattr(_versions, "TORCH_VERSION", version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _versions.warn_if_untested()


def test_regions_a_torch_cannot_run_are_said_to_be_off_once(monkeypatch):
    monkeypatch.setattr(_versions, "REGIONS_SUPPORTED", False)
    monkeypatch.setattr(_versions, "_regions_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _versions.warn_if_regions_cannot_run(compile_regions=False)  # regions not asked for
    with pytest.warns(_versions.RegionsOffWarning, match="compile regions are off on torch .*reuse_hash_fn"):
        _versions.warn_if_regions_cannot_run(compile_regions=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _versions.warn_if_regions_cannot_run(compile_regions=True)  # once
