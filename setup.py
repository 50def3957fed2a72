"""Package setup for lemon_rl."""

from setuptools import find_packages, setup

setup(
    name="lemon_rl",
    version="0.1.0",
    description="JAX/Flax research library for RL post-training of language models.",
    packages=find_packages(include=["lemon_rl", "lemon_rl.*"]),
    python_requires=">=3.11",
    install_requires=[
        "jax>=0.10.2",
        "flax>=0.12.8",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12.8",
        "chex>=0.1.92",
        "tensorflow-datasets>=4.9.10",
        "array_record>=0.8.6",
        "grain>=0.2.18",
        "ml-collections>=1.1.0",
        "absl-py>=2.5.1",
        "numpy>=2.0",
        "scipy>=1.17",
        "safetensors>=0.8.0",
        "tokenizers>=0.23",
        "jinja2>=3.1.6",  # Chat templates (lemon_rl/text/chat_template.py), rendered as transformers does.
        "pyyaml>=6.0",  # LEMON orchestration specs (lemon_rl/envs/orchestration); also a dependency of flax.
        "tqdm>=4.70",
        "tensorboardX>=2.6",
        "matplotlib>=3.10",
        "math-verify>=0.9.0",  # The math answer reward (lemon_rl/rewards/math_verify_reward.py).
    ],
    extras_require={
        # Offline GSM-Symbolic problems for the gsm8k task (lemon_rl/envs/math_data.py, source="gsm_symbolic").
        "reasoning": ["reasoning-gym>=0.1.25"],
        # Hugging Face parquet/arrow files and save_to_disk folders as task data (lemon_rl/envs/math_data.py).
        "hf_datasets": ["datasets>=5.2"],
        # torch must be installed first (`pip install torch==2.13.0`, a local CPU build here) so that
        # transformers does not pull a CUDA build; see README.
        "test": [
            "pytest>=9.0",
            "pytest-xdist>=3.8",  # The suite runs on two workers (-n 2): compiles dominate, one core each.
            "hypothesis>=6.150",
            "transformers>=5.24",
            "nbformat>=5.10",
            "nbclient>=0.10",
            "ipykernel>=6.29",
            # bfcl-eval's AST checker (bfcl-eval itself is installed with --no-deps: it pins numpy 1.26).
            "tree_sitter==0.21.3",
            "tree-sitter-java==0.21.0",
            "tree-sitter-javascript==0.21.4",
            "filelock>=3.12",
            "tenacity>=8.2",
            # FrozenLake parity tests (lemon_rl/envs/frozenlake.py is pure numpy at run time).
            "gymnasium>=1.4.0",
            # The optional data sources, so their tests run rather than skip.
            "reasoning-gym>=0.1.25",
            "datasets>=5.2",
        ],
    },
)
