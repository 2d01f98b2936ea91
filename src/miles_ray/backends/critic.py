"""The PPO critic on one rank: the policy's transformer with a scalar value head, trained on GAE returns.

``ValueModel`` is the HF base model (``AutoModel``, no LM head) plus ``value_head``, a zero-initialised
``Linear(hidden, 1)``: values start at 0, so the first advantages are the (whitened) discounted rewards.
The value of position ``t`` (``[B, T-1]`` alignment, like logprobs) is read from the hidden state that
predicts token ``t+1``: the state before that token is sampled.

Usage (inside a rank whose ``torch.distributed`` default group is initialised)::

    critic = TorchCriticBackend(TorchBackendConfig(), OptimizerConfig(lr=1e-5), model_path, value_clip=0.2)
    values = critic.compute_values(shard)                     # [B, T-1]
    metrics = critic.train_step(shard, old_values, returns)   # one optimizer step on 0.5 (V - R)^2
"""

from __future__ import annotations

import torch

from miles_ray.algo.losses import value_loss
from miles_ray.backends.base import OptimizerConfig, TorchBackendConfig
from miles_ray.backends.torch_rank import TorchRank, param_dtype
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

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` value of every position's state."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.value_head(hidden).sum(-1).float()  # sum over the size-1 dim: a new tensor, not a view


class TorchCriticBackend(TorchRank):
    """One data-parallel rank of the critic, FSDP2 or DDP like the policy."""

    def __init__(
        self,
        config: TorchBackendConfig,
        optim: OptimizerConfig,
        model_path: str,
        value_clip: float | None = 0.2,
        head_lr: float | None = None,
    ):
        self.head_lr = head_lr  # read by param_groups during super().__init__
        super().__init__(config, optim, ValueModel(model_path, param_dtype(config)))
        self.value_clip = value_clip

    def param_groups(self) -> list[dict]:
        """The zero-initialised head may learn faster than the pretrained transformer (``head_lr``)."""
        if self.head_lr is None:
            return super().param_groups()
        named = list(self.model.named_parameters())
        head = [p for n, p in named if n.startswith("value_head.")]
        body = [p for n, p in named if not n.startswith("value_head.")]
        return [{"params": body}, {"params": head, "lr": self.head_lr}]

    def _values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            values = self.model(input_ids.to(self.device), attention_mask.to(self.device))
        return values[:, :-1]  # position t values the state that predicts token t+1

    @torch.no_grad()
    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """``[B, T-1]`` values of this rank's batch, 0 off the response mask, fp32 on CPU."""
        self.model.eval()
        mbs = self.config.micro_batch_size
        parts = [
            self._values(batch.input_ids[i : i + mbs], batch.attention_mask[i : i + mbs]).cpu()
            for i in range(0, batch.num_samples, mbs)
        ]
        return torch.cat(parts) * batch.response_mask

    def train_step(self, batch: RolloutBatch, old_values: torch.Tensor, returns: torch.Tensor) -> dict[str, float]:
        """One optimizer step on the (clipped) value loss over this rank's shard; metrics averaged over ranks.

        Args:
            batch: this rank's samples.
            old_values: ``[B, T-1]`` values the returns were computed with.
            returns: ``[B, T-1]`` GAE returns (value targets).

        """
        import torch.distributed as dist

        self.model.train()
        mask_all = batch.response_mask
        global_units = self.global_sum(float(mask_all.sum()))
        mbs = self.config.micro_batch_size
        sums = {"loss": 0.0, "tokens": 0.0, "value_clipfrac": 0.0}
        starts = list(range(0, batch.num_samples, mbs))
        for i in starts:
            sl = slice(i, i + mbs)
            self.grad_sync(i == starts[-1])
            mask = mask_all[sl].to(self.device)
            tokens = float(mask.sum())
            values = self._values(batch.input_ids[sl], batch.attention_mask[sl])
            target = returns[sl].to(self.device)
            loss, m = value_loss(values, old_values[sl].to(self.device), target, mask, self.value_clip)
            self.backward_share(loss, tokens, global_units)
            sums["loss"] += float(loss.detach()) * tokens
            sums["value_clipfrac"] += m["value_clipfrac"] * tokens
            sums["tokens"] += tokens
        grad_norm, skipped = self.clip_and_step(sums["loss"])
        reduced = torch.tensor(list(sums.values()), dtype=torch.float64)
        dist.all_reduce(reduced)
        r = dict(zip(sums, reduced.tolist()))
        tokens = max(r["tokens"], 1.0)
        return {
            "value_loss": r["loss"] / tokens,
            "value_clipfrac": r["value_clipfrac"] / tokens,
            "grad_norm": grad_norm,
            "step_skipped": float(skipped),
            "num_tokens": r["tokens"],
        }


__all__ = ["TorchCriticBackend", "ValueModel"]
