"""StageWorker.backward hands grad_output to autograd through a scalar's backward instead
of calling out.backward(grad_output) (which imports sympy): the gradients must be the
same bits."""

import pytest
import torch

from swarm_node.data.spec import DataSpec
from swarm_node.optim import default_method
from swarm_node.spec import RunSpec
from swarm_node.train.worker import StageWorker

SPEC = RunSpec(run_id="backward", model_size="tiny", num_stages=3, seq_len=16, batch_size=4,
               samples_per_step=4,
               data=DataSpec(kind="synthetic"), method=default_method("noloco", inner_steps=10))


@pytest.mark.parametrize("stage", [0, 1])
def test_backward_gives_exactly_the_gradients_of_backward_with_a_gradient(stage):
    worker, reference = StageWorker(SPEC, stage, 16), StageWorker(SPEC, stage, 16)
    g = torch.Generator().manual_seed(stage)
    hidden_size = worker.model_config.hidden_size
    inputs = torch.randint(0, 16, (4, 16), generator=g) if stage == 0 else torch.randn(4, 16, hidden_size,
                                                                                       generator=g)
    grad_output = torch.randn(4, 16, hidden_size, generator=g)
    grad_input = worker.backward(inputs, grad_output)
    x = inputs if stage == 0 else inputs.detach().clone().requires_grad_(True)
    reference.stage(x).float().backward(grad_output)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(worker.params, reference.params))
    assert grad_input is None if stage == 0 else torch.equal(grad_input, x.grad)
