"""Resume refuses a model whose chunks have the same element counts but another
parameter layout (issue 8, item 7): the daemon stores a fingerprint of each
chunk's shapes, dtypes and order with the job."""

import pytest
import torch

import fuyou
from fuyou._chunking import plan_chunks


def _one_step(opt, model, inputs):
    model(inputs).sum().backward()
    opt.step()
    opt.zero_grad()


def test_fingerprint_is_stable_and_tells_layouts_apart():
    a = plan_chunks([list(torch.nn.Linear(8, 8).parameters())], 1 << 20)[0]
    b = plan_chunks([list(torch.nn.Linear(8, 8).parameters())], 1 << 20)[0]
    c = plan_chunks([list(torch.nn.Linear(6, 12, bias=False).parameters())], 1 << 20)[0]
    assert [x.num_elements for x in a] == [x.num_elements for x in c] == [72]
    assert a[0].layout_fingerprint == b[0].layout_fingerprint != 0
    assert a[0].layout_fingerprint != c[0].layout_fingerprint
    d = plan_chunks([list(torch.nn.Linear(8, 8).half().parameters())], 1 << 20)[0]
    assert d[0].layout_fingerprint != a[0].layout_fingerprint  # dtype counts too


def test_resume_with_other_shapes_same_size_is_refused(backend):
    job = backend.new_job("layout")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = backend.adamw(model.parameters(), job=job, lr=0.1)
    _one_step(opt, model, torch.randn(4, 8))
    committed = opt.committed_step
    opt.close()

    other = torch.nn.Linear(6, 12, bias=False)  # 72 elements too, in another layout
    with pytest.raises(fuyou.FailedPrecondition) as refused:
        backend.adamw(other.parameters(), job=job)
    message = str(refused.value)
    assert "fingerprint" in message and "chunk 0" in message, message
    if backend.name == "daemon":
        assert "use a new job name or the model the job was created with" in message, message
        assert "12x6 float32" in message, message  # the client names its own layout

    # The refusal changed nothing: the original model still resumes, at its step.
    again = torch.nn.Linear(8, 8)
    opt = backend.adamw(again.parameters(), job=job)
    assert opt.resumed and opt.committed_step == committed
    torch.testing.assert_close(again.weight, model.weight, rtol=0, atol=0)
    torch.testing.assert_close(again.bias, model.bias, rtol=0, atol=0)
    opt.close()
