"""Pipeline parallelism inside autograd: one micro-batch runs through the stages, and its backward back.

The Trainer computes every micro-batch's loss on every rank and calls ``backward`` on it, so each
pipeline stage must return the model's outputs (log-probs, values) as if it held the whole model,
and its ``backward`` must drive the stages' backward passes in reverse. Three pieces do that:

- stage ``s > 0`` starts with :func:`receive_forward`: the previous stage's output; in the backward
  pass it sends the gradient of that tensor back.
- stage ``s < last`` ends with :func:`send_and_receive_outputs`: it sends its hidden states on and
  receives the last stage's outputs (a broadcast over the pipeline group); in the backward pass it
  receives the gradient of its hidden states from the next stage. The gradient of the outputs it
  returned is dropped: every stage computes the same loss from the same outputs, and the last stage
  backpropagates its own copy.
- the last stage computes the outputs and broadcasts them (:func:`broadcast_outputs`).

Every rank takes part in each send, receive and broadcast in the same order, so plain blocking
point-to-point calls suffice (gloo on CPU, NCCL on GPU). This is the simplest correct schedule: one
micro-batch at a time, a stage idles while the others work ((P - 1) / P of the time for P stages,
without overlap). Megatron's 1F1B and interleaved schedules need the whole micro-batch loop in their
hands (forward and loss of many micro-batches before the backward), which the Trainer's loop does
not give; see docs/megatron.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


class _ReceiveForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor: Tensor, shape: tuple, device: torch.device, prev_rank: int) -> Tensor:
        ctx.prev_rank = prev_rank
        buf = torch.empty(shape, dtype=torch.float32, device=device)
        dist.recv(buf, prev_rank)
        return buf

    @staticmethod
    def backward(ctx, grad: Tensor):
        dist.send(grad.float().contiguous(), ctx.prev_rank)
        return None, None, None, None


class _SendAndReceiveOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, out_shape: tuple, next_rank: int, last_rank: int, group) -> Tensor:
        ctx.next_rank, ctx.shape = next_rank, hidden.shape
        dist.send(hidden.contiguous(), next_rank)
        out = torch.empty(out_shape, dtype=torch.float32, device=hidden.device)
        dist.broadcast(out, src=last_rank, group=group)
        return out

    @staticmethod
    def backward(ctx, _grad_out: Tensor):
        grad = torch.empty(ctx.shape, dtype=torch.float32, device=_grad_out.device)
        dist.recv(grad, ctx.next_rank)
        return grad, None, None, None, None


def receive_forward(shape: tuple, device: torch.device) -> Tensor:
    """The previous stage's output ``shape`` (float32); its gradient goes back in the backward pass."""
    from megatron.core import parallel_state as ps

    # a zero-size leaf that requires grad: it makes autograd call the backward (the send) of this node
    anchor = torch.empty(0, device=device, requires_grad=torch.is_grad_enabled())
    return _ReceiveForward.apply(anchor, shape, device, ps.get_pipeline_model_parallel_prev_rank())


def send_and_receive_outputs(hidden: Tensor, out_shape: tuple) -> Tensor:
    """Send ``hidden`` to the next stage; return the last stage's outputs ``out_shape`` (float32)."""
    from megatron.core import parallel_state as ps

    return _SendAndReceiveOutputs.apply(hidden.float(), out_shape, ps.get_pipeline_model_parallel_next_rank(),
                                        ps.get_pipeline_model_parallel_last_rank(),
                                        ps.get_pipeline_model_parallel_group())


def broadcast_outputs(out: Tensor) -> Tensor:
    """On the last stage: send ``out`` to the other stages (its own gradient path is unchanged)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(out.detach().float().contiguous(), src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    return out


def run_stages(lm, input_ids: Tensor, head, out_shape: tuple, images=None) -> Tensor:
    """Outputs ``out_shape`` of ``head`` (applied on the last stage to its ``[S, B, H]`` hidden states), on every stage.

    ``lm`` is a :class:`~rlflow.strategies.megatron.model.MegatronLM`; ``head`` returns a float32 tensor of
    ``out_shape``. ``images``: a vision-language batch's (:class:`~rlflow.strategies.megatron.vision.VisionBatch`).
    """
    B, S = input_ids.shape
    stage_input = None
    if not lm.first_stage:
        stage_input = receive_forward((S // lm.sequence_chunk(), B, lm.config.hidden_size), input_ids.device)
    hidden = lm.hidden_states(input_ids, stage_input, images)
    if lm.last_stage:
        return broadcast_outputs(head(hidden))
    return send_and_receive_outputs(hidden, out_shape)
