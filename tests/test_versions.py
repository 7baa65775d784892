"""The supported torch releases: a newer one warns once at import, naming the range; an older one is refused."""

import warnings

import pytest

from compile_shard import _versions


def test_a_newer_torch_warns_naming_the_tested_range(monkeypatch):
    monkeypatch.setattr(_versions, "TORCH_VERSION", (2, 16))
    with pytest.warns(_versions.UntestedTorchWarning, match=r"tested with torch 2\.13 to 2\.15; this is torch"):
        _versions.warn_if_untested()


def test_an_older_torch_is_refused_naming_what_to_install(monkeypatch):
    monkeypatch.setattr(_versions, "TORCH_VERSION", (2, 11))
    with pytest.raises(ImportError, match=r"needs torch 2\.13 or later .* pip install torch==2\.13\.0"):
        _versions.warn_if_untested()


@pytest.mark.parametrize("version", _versions.SUPPORTED)
def test_a_tested_torch_does_not_warn(monkeypatch, version):
    monkeypatch.setattr(_versions, "TORCH_VERSION", version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _versions.warn_if_untested()
