"""The PPO critic on one rank: the policy's transformer with a scalar value head, trained on GAE returns.

``ValueModel`` is the HF base model (``AutoModel``, no LM head) plus ``value_head``, a zero-initialised
``Linear(hidden, 1)``: values start at 0, so the first advantages are the (whitened) discounted rewards.
The value of position ``t`` (``[B, T-1]`` alignment, like logprobs) is read from the hidden state that
predicts token ``t+1``: the state before that token is sampled.

It implements the ``CriticBackend`` primitives (``backends.interface``); the value loss and its update are
``backends.rl_step`` (``critic_values``, ``value_update``).

Usage (inside a rank whose ``torch.distributed`` default group is initialised)::

    critic = TorchCriticBackend(TorchBackendConfig(), OptimizerConfig(lr=1e-5), model_path)
    values = rl_step.critic_values(critic, shard)                                    # [B, T-1]
    metrics = rl_step.value_update(critic, shard, values, returns, value_clip=0.2)   # 0.5 (V - R)^2, one step
"""

from __future__ import annotations

import torch

from miles_ray.backends.optimizer import OptimizerConfig
from miles_ray.backends.packing import pack_rows
from miles_ray.backends.torch_parallel import DataParallelModel, TorchBackendConfig, param_dtype
from miles_ray.types import RolloutBatch


class ValueModel(torch.nn.Module):
    """HF decoder + scalar head: ``forward(input_ids, attention_mask) -> [B, T]`` values."""

    def __init__(self, model_path: str, dtype: torch.dtype):
        super().__init__()
        from transformers import AutoModel

        self.model = AutoModel.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa")
        self.model.config.use_cache = False
        self.value_head = torch.nn.Linear(self.model.config.hidden_size, 1, dtype=dtype)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def gradient_checkpointing_enable(self) -> None:
        """Recompute the decoder's activations in backward."""
        self.model.gradient_checkpointing_enable()

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[B, T]`` value of every position's state (a 4D ``attention_mask`` and ``position_ids``: packed rows)."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        hidden = hidden.last_hidden_state
        return self.value_head(hidden).sum(-1).float()  # sum over the size-1 dim: a new tensor, not a view


class TorchCriticBackend(DataParallelModel):
    """One data-parallel rank of the critic, FSDP2 or DDP like the policy."""

    def __init__(
        self, config: TorchBackendConfig, optim: OptimizerConfig, model_path: str, head_lr: float | None = None
    ):
        self.head_lr = head_lr  # read by param_groups during super().__init__
        super().__init__(config, optim, ValueModel(model_path, param_dtype(config)))

    def param_groups(self) -> list[dict]:
        """The zero-initialised head may learn faster than the pretrained transformer (``head_lr``)."""
        if self.head_lr is None:
            return super().param_groups()
        named = list(self.model.named_parameters())
        head = [p for n, p in named if n.startswith("value_head.")]
        body = [p for n, p in named if not n.startswith("value_head.")]
        return [{"params": body}, {"params": head, "lr": self.head_lr}]

    def forward_values(self, batch: RolloutBatch) -> torch.Tensor:
        """``[B, T-1]`` values of ``batch`` on this rank's device (position ``t``: the state predicting ``t+1``).

        Packed (``config.packing``), a shared prompt's states are computed once; positions that predict no response
        token are 0 then (the value loss masks them anyway).
        """
        p = self.config.packing
        if p is None:
            with self.forward_context():
                values = self.model(batch.input_ids.to(self.device), batch.attention_mask.to(self.device))
            return values[:, :-1]
        packed = pack_rows(batch, p.share_prefix, p.max_row_tokens)
        with self.forward_context():
            values = self.model(
                packed.input_ids.to(self.device),
                packed.attention.to(self.device),
                packed.position_ids.to(self.device),
            )
        return packed.scatter(packed.needed(values))


__all__ = ["TorchCriticBackend", "ValueModel"]
