"""What the Python suites share: a client of the module's server, and heads with fresh names.

A module defines its own `server` fixture (the flags differ: a budget that splits calls into
chunks, metrics, heads from checkpoints), usually through server_process.demo_server; the
`client` here connects to it once per module. `new_head` uploads a random W under a fresh name,
so that no test sees another's gradient or steps."""
import uuid

import numpy as np
import pytest
import torch

from server_process import ensure_python_client

ensure_python_client()
import lossd  # noqa: E402
from lossd.torch import RemoteHead  # noqa: E402


def fresh_name(prefix):
    """A head name no other test uses: `prefix` and 12 random hex digits."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def random_weight(rows, columns, scale=1.0):
    """W [rows, columns] in fp32, standard normal times `scale`, from a fresh seed."""
    return np.random.default_rng().standard_normal((rows, columns), dtype=np.float32) * scale


@pytest.fixture(scope="module")
def client(server):
    with lossd.Client(server.address, timeout=600) as c:
        yield c


@pytest.fixture
def new_head(client):
    """new_head(vocab, hidden, scale=0.3, prefix="test"): a RemoteHead with a random W."""
    def make(vocab, hidden, scale=0.3, prefix="test"):
        weight = random_weight(vocab, hidden, scale)
        return RemoteHead.upload(client, fresh_name(prefix), torch.from_numpy(weight))
    return make
