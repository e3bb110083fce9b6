from setuptools import find_packages, setup

SERVE = ["fastapi>=0.110", "uvicorn>=0.29", "prometheus-client>=0.20", "httpx>=0.27"]  # httpx: bench-serve

setup(
    name="tllm_spec",
    version="0.1.0",
    description="One-model speculative decoding (EAGLE-3, MTP) for Hugging Face causal LMs",
    python_requires=">=3.10",
    packages=find_packages(include=["tllm_spec", "tllm_spec.*"]),
    package_data={"tllm_spec": ["assets/**/*"]},
    install_requires=[
        "torch>=2.4",
        "transformers>=4.56",
        "safetensors>=0.4",
        "tokenizers>=0.20",
        "pydantic>=2.6",
        "pyyaml>=6",
        "tqdm>=4.60",
    ],
    extras_require={
        # triton: the kernels are checked against their references under its CPU interpreter
        "test": ["pytest>=8", "pytest-xdist>=3.2", "scipy>=1.10", "triton>=3.0", "llguidance>=1.0", "jsonschema>=4",
                 *SERVE, "openai>=1.30", "matplotlib>=3.7"],  # matplotlib: the benchmark plots are tested too
        "guided": ["llguidance>=1.0"],
        "serve": SERVE,
        "gpu": ["flashinfer-python>=0.7", "triton>=3.0"],
        "plot": ["matplotlib>=3.7"],
    },
    entry_points={"console_scripts": ["tllm-spec=tllm_spec.serve.cli:main"]},
)
