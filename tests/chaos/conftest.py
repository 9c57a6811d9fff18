import pytest


@pytest.fixture(autouse=True)
def _ray(ray_session):
    return ray_session
