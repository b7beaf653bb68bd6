# The image that scripts/make_jobset.py's JobSets run: this repository installed with the
# extras of one accelerator. Build it from the repository root (docs/scale_out.md):
#   docker build --build-arg EXTRAS=tpu,gcs  -t diloco:tpu  .   # Cloud TPU VMs (libtpu)
#   docker build --build-arg EXTRAS=cuda,gcs -t diloco:cuda .   # CUDA 12 GPUs
# then tag and push it where the cluster pulls from, and pass that name as --image:
#   docker tag diloco:tpu REGION-docker.pkg.dev/PROJECT/REPO/diloco:tpu
#   docker push REGION-docker.pkg.dev/PROJECT/REPO/diloco:tpu
# The CUDA build needs no CUDA base image: jax[cuda12] brings the CUDA, cuDNN and NCCL
# libraries as wheels; the node supplies only the driver (GKE mounts it at /usr/local/nvidia).
ARG PYTHON=3.11
FROM python:${PYTHON}-slim

ARG EXTRAS=tpu,gcs
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LD_LIBRARY_PATH=/usr/local/nvidia/lib64

WORKDIR /opt/diloco
# Dependencies first, in a layer that changes only with setup.py: a stub package lets pip
# resolve and install them; the code then goes in without touching them.
COPY setup.py README.md ./
RUN mkdir diloco && touch diloco/__init__.py \
    && pip install ".[${EXTRAS}]" \
    && pip uninstall -y diloco && rm -rf diloco build ./*.egg-info
COPY diloco ./diloco
COPY configs ./configs
COPY scripts ./scripts
COPY experiments ./experiments
RUN pip install --no-deps -e . && mkdir -p /work

# The manifests run `python -m diloco.main --config=configs/... --workdir=/work ...` here.
CMD ["python", "-m", "diloco.main", "--helpshort"]
