import pytest

from zerostack.nvme import BACKENDS, tensornvme_backends

AVAILABLE = [b for b in BACKENDS if b == "threads" or b in tensornvme_backends()]


@pytest.fixture(params=AVAILABLE)
def backend(request):
    return request.param
