"""What a model is: configs and one short file per architecture family."""
from .config import (MOE_ARCHS, SUPPORTED_ARCHS, ModelConfig, UnsupportedArchitecture, UnsupportedModelFile,
                     check_tensors, config_from_gguf, tensor_shapes, unfuse)


def model_class(arch: str):
    if arch in ("llama", "qwen2", "qwen3", "qwen3moe", "smollm3", "phi3"):   # phi3: once unfused (models.unfuse)
        from .llama import Llama
        return Llama
    if arch == "gemma3":
        from .gemma3 import Gemma3
        return Gemma3
    if arch == "gpt-oss":
        from .gpt_oss import GptOss
        return GptOss
    raise UnsupportedArchitecture(f"model architecture '{arch}' is not supported "
                                  f"(supported: {', '.join(SUPPORTED_ARCHS)})")
