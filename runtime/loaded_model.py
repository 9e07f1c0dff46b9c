"""What loading a model gives: its config, its weight tensors in their stored block
layout (views into the memory map for GGUF files), its tokenizer and metadata.  Both
loaders (`loader` for GGUF files, `safetensors_loader` for checkpoint folders) build it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from models import ModelConfig


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    tensors: dict          # name -> QTensor
    tokenizer: object
    metadata: dict = field(default_factory=dict)
    chat_template: str | None = None

    @property
    def n_params(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors.values())

    @property
    def n_active_params(self) -> int:
        """Parameters a token reads: all but the experts it does not choose (mixture of
        experts: n_experts_used of n_experts in each layer); n_params for dense models."""
        cfg = self.config
        if not cfg.n_experts:
            return self.n_params
        idle = sum(math.prod(t.shape) for n, t in self.tensors.items() if "_exps." in n)   # (and their biases)
        return self.n_params - idle * (cfg.n_experts - cfg.n_experts_used) // cfg.n_experts

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())
