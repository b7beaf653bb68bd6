"""Installs the `diloco` package: `pip install -e ".[test]"` (CPU), `".[cuda]"`, `".[tpu]"`."""

from setuptools import find_packages, setup

setup(
    name="diloco",
    version="0.1.0",
    description=("Decoupled DiLoCo in JAX: asynchronous, fault-tolerant, low-bandwidth "
                 "pre-training of language models across independent accelerator islands."),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    # diloco.configs is the repository's configs/ (a link in the checkout), so the presets
    # ship with the package: `diloco --config=decoupled:tiny` works from any directory.
    packages=find_packages(include=["diloco", "diloco.*"]),
    install_requires=[
        # Python 3.11 resolves jax 0.10.x / flax 0.12.8; 3.12+ gets the newer releases.
        "jax>=0.10.2,<0.13",
        "jaxlib>=0.10.2,<0.13",
        "flax>=0.12.8,<0.13",
        "optax>=0.2.8,<0.3",
        "orbax-checkpoint>=0.12.8,<1.0",
        "grain>=0.2.18,<0.3",
        "array-record>=0.8",
        "ml-collections>=1.1,<2",
        "absl-py>=2.5,<3",
        "numpy>=1.26,<3",
        "matplotlib>=3.8,<4",
        "sentencepiece>=0.2,<0.3",
        "tensorboardX>=2.6,<3",
        # Imported directly too (tests/packaging_test.py checks that every import is declared).
        "etils[epath]>=1.5,<2",
        # Corpus files behind URLs (diloco/train/storage.py); 2024.12 added the create-only
        # write (`pipe_file(mode="create")`) the store's lease takes on object stores.
        "fsspec>=2024.12",
        "ml-dtypes>=0.5,<1",
        "PyYAML>=6,<7",
        "scipy>=1.14,<2",
        # The export's optional model.safetensors (diloco/artifacts/export.py), read without JAX.
        "safetensors>=0.4,<1",
    ],
    extras_require={
        # Record sources (parquet, `datasets` directories) and tokenizer.json files
        # (docs/data.md); `datasets` itself is only needed to write directories.
        "hf": ["pyarrow>=15", "tokenizers>=0.15,<1"],
        # Tests also read TensorBoard event files back, run wandb in offline mode, write
        # `datasets` directories, draw values around the config's bounds (hypothesis) and run
        # the store on a local Cloud Storage emulator through gcsfs (tests/gcs_emulator.py;
        # 2026.7 is the release those tests were written against).
        "test": ["pytest>=8,<10", "pytest-xdist>=3.6,<4", "pyarrow>=15", "tokenizers>=0.15,<1",
                 "datasets>=3,<6", "tensorboard>=2.14,<3", "wandb>=0.20,<1",
                 "hypothesis>=6.100,<7", "gcsfs>=2024.12", "gcp-storage-emulator>=2026.7,<2027",
                 # The linter `.ci/run` runs first (pyproject.toml's [tool.ruff]).
                 "ruff>=0.17.6,<0.18",
                 # Line coverage of the package over the suite (scripts/suite_coverage.sh).
                 "coverage>=7.10,<8",
                 # libtpu, the TPU compiler: `diloco compile` compiles for TPU slices on any
                 # host (tests/tpu_compile_test.py); the tests run with JAX_PLATFORMS=cpu.
                 "jax[tpu]>=0.10.2,<0.13",
                 # Benchmarks through lm-evaluation-harness, and the Hugging Face export loaded
                 # back by transformers. torch is pinned to the CPU build this machine kind keeps
                 # on disk for Python 3.11 (any other torch is a download of several GB); on
                 # other Pythons the tests marked `torch` need `pip install torch` first.
                 "lm-eval>=0.4.9,<0.5", "transformers>=5,<6",
                 "torch==2.13.0; python_version=='3.11'",
                 # lm_eval's "hf" model (scoring the transformers export the same way).
                 "accelerate>=1,<2; python_version=='3.11'"],
        # Scoring a run on lm-evaluation-harness tasks (`diloco evaluate --tasks=...`).
        "lm-eval": ["lm-eval>=0.4.9,<0.5"],
        # Loading an export written with `--format=hf` into transformers (needs PyTorch).
        # protobuf: transformers' reader of a SentencePiece model, when the export converts one.
        "transformers": ["transformers>=5,<6", "torch>=2.4", "protobuf>=3.20"],
        # viewing the event files every run writes (tensorboardX writes them)
        "tensorboard": ["tensorboard>=2.14,<3"],
        # log.wandb=True
        "wandb": ["wandb>=0.20,<1"],
        # A gs:// store, workdir or data.path (etils.epath and fsspec use gcsfs for GCS).
        "gcs": ["gcsfs>=2024.12"],  # 2024.12: create-only writes (ifGenerationMatch=0)
        # Accelerators: JAX's own extras within the pinned range. CUDA 12 GPUs (the CUDA, cuDNN
        # and NCCL wheels come from PyPI; only an NVIDIA driver is needed on the host) and
        # Cloud TPU VMs (libtpu). `pip install -e ".[cuda,gcs]"`, `pip install -e ".[tpu,gcs]"`.
        "cuda": ["jax[cuda12]>=0.10.2,<0.13"],
        "tpu": ["jax[tpu]>=0.10.2,<0.13"],
        # scripts/bench_maxtext.py: MaxText beside diloco, compiled by one libtpu (MaxText's
        # PyPI release needs Python 3.12; `pip install -e ".[maxtext]"` there).
        "maxtext": ["maxtext[tpu]==0.2.5; python_version>='3.12'"],
    },
    # `diloco [train] --config=... --workdir=...` is `python -m diloco.main ...`; `diloco compare`,
    # `sample` and `evaluate` are the tools around a run (diloco/cli/commands.py, `diloco --help`).
    entry_points={"console_scripts": ["diloco = diloco.cli.commands:main"]},
    classifiers=[
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
