"""The family tests' fixtures: each served family's tiny checkpoint and adapters, written once per session."""

from __future__ import annotations

import pytest

from tests.runtime.families._models import FAMILIES, WrittenFamily, write_family


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> WrittenFamily:
    return write_family(tmp_path_factory.mktemp(f"family-{request.param}"), request.param)
