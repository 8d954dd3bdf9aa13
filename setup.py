"""megarl: Megatron-native RL post-training for LLMs.

Versions are pinned to what was verified on the CPU dev/CI machines (Python 3.11) and carried to
the GPU box. megatron-core 0.17+ requires Python >= 3.12, so 0.16.1 is the one version that runs on
both. Install torch first (`pip install torch==2.13.0`) so no dependency
pulls a CUDA build on CPU machines.
"""
from setuptools import find_packages, setup

CORE = [
    "torch>=2.6,<=2.14.1",
    "megatron-core==0.16.1",
    "ray[default]==2.60.0",
    "pyyaml>=6.0",
    "safetensors==0.8.0",
    "tensorboard==2.21.0",
    "transformers==5.24.0",
    "tokenizers==0.23.3",
    "aiohttp==3.14.5",
    "numpy>=1.26",
    "psutil>=5.9",  # megatron dist_checkpointing writer processes need it
    "py-spy>=0.4.2",  # the watchdog reads a stopped rank's stack with it (megarl/workers/stack_dump.py)
]

EXTRAS = {
    # Everything the test-suite needs beyond the core: a real small model (GGUF, dequantised by
    # transformers + gguf) and procedural reasoning tasks with scorers.
    "test": [
        "pytest>=8",
        "gguf==0.19.0",
        "reasoning-gym==0.1.25",
        "pyarrow>=15",
        # metric sinks besides TensorBoard (logging.sinks), read back by tests/test_trainer_moe.py;
        # neither pulls torch. mlflow-skinny is MLflow's tracking client (file store, no server deps)
        "wandb==0.31.0",
        "mlflow-skinny==3.18.0",
        "bm25s==0.3.16",    # agent.env=search (BM25 over a local corpus); needs only numpy + scipy
        # LoRA's independent reference: peft loads megarl's exported adapters onto the HF model
        # (tests/test_lora*.py); peft imports accelerate. Neither pulls torch past the pinned one.
        "peft==0.21.2",
        "accelerate==1.16.0",
        "math-verify==0.9.0",   # reward.rule math_verify, graded against the package itself
        # bring-your-own agents: the tests' agents are written with the real OpenAI client, calling
        # the gateway (tests/test_gateway.py, the byo-agent recipe's example agent)
        "openai==2.54.0",
        # environment hubs trained as published (megarl/envs/hubs/): verifiers and OpenEnv, each
        # tested against the package's own environment classes (tests/test_hub_*.py)
        "verifiers==0.4.0",
        "openenv-core==0.3.0",
        # the documentation site (docs/, mkdocs.yml): tests/test_docs.py builds it with --strict
        "mkdocs==1.6.1",
        "mkdocs-material==9.8.2",
    ],
    # Agentic RL environments: BM25 retrieval for agent.env=search. The python sandbox needs
    # Debian's bubblewrap (apt-get install bubblewrap; launch/install.sh does it), not a wheel.
    "agent": ["bm25s==0.3.16"],
    # environment hubs (agent.entrypoint: megarl.envs.hubs.<hub>:run): verifiers needs openai>=2.54
    "hubs": ["verifiers==0.4.0", "openenv-core==0.3.0", "openai==2.54.0"],
    "sinks": ["wandb==0.31.0", "mlflow-skinny==3.18.0"],
    # reward.rule math_verify (the math recipes' grader): HF math-verify, pure Python (latex2sympy2_extended,
    # antlr4 runtime, sympy; no torch). An extra, not core: only math recipes use it, and its antlr4 pin
    # (<= 4.13.2) should not constrain installs that grade nothing with it.
    "math": ["math-verify==0.9.0"],
    # GPU-only engines. apex is not on PyPI: build it from source if wanted (README).
    "gpu": [
        "transformer-engine[pytorch]>=2.4",
        "sglang==0.5.23",
    ],
    "data": ["reasoning-gym==0.1.25", "gguf==0.19.0", "pyarrow>=15"],
    "docs": ["mkdocs==1.6.1", "mkdocs-material==9.8.2"],
}

setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-Core RL post-training (PPO, GRPO, DAPO) with SGLang-API rollout",
    python_requires=">=3.11",
    packages=find_packages(include=["megarl", "megarl.*"]),
    package_data={"megarl": ["py.typed"]},
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["megarl=megarl.cli:main"]},
)
