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
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())
