#!/bin/sh
# The TPU points of experiments/sweep, rendered by `python -m experiments.sweep.run`; not run by it.
set -e

# gemma_2b dp: on every host of one v5p-64 slice
python -m diloco.main --config=configs/dp.py:gemma_2b --workdir=gs://your-bucket/sweep/gemma-2b-dp --jax_distributed --config.data.path=gs://your-bucket/tokens

# gemma_2b diloco M=8 K=8 H=24: 8 x v5p-64 + a CPU syncer
diloco jobset --name=dd-gemma-2b-diloco-m8-k8-h24 --image=REGISTRY/diloco:latest --store=gs://your-bucket/sweep/gemma-2b-diloco-m8-k8-h24 --config=configs/diloco.py:gemma_2b --learners=8 --tpu_type=v5p-64 --override=data.path=gs://your-bucket/tokens --override=sync.period=24 --override=sync.num_fragments=1 --output=gemma-2b-diloco-m8-k8-h24.yaml
kubectl apply -f gemma-2b-diloco-m8-k8-h24.yaml

# gemma_2b streaming M=8 K=8 H=24: 8 x v5p-64 + a CPU syncer
diloco jobset --name=dd-gemma-2b-streaming-m8-k8-h24 --image=REGISTRY/diloco:latest --store=gs://your-bucket/sweep/gemma-2b-streaming-m8-k8-h24 --config=configs/streaming.py:gemma_2b --learners=8 --tpu_type=v5p-64 --override=data.path=gs://your-bucket/tokens --override=sync.period=24 --override=sync.num_fragments=24 --output=gemma-2b-streaming-m8-k8-h24.yaml
kubectl apply -f gemma-2b-streaming-m8-k8-h24.yaml

# gemma_2b decoupled M=8 K=1 H=24: 8 x v5p-64 + a CPU syncer
diloco jobset --name=dd-gemma-2b-decoupled-m8-k1-h24 --image=REGISTRY/diloco:latest --store=gs://your-bucket/sweep/gemma-2b-decoupled-m8-k1-h24 --config=configs/decoupled.py:gemma_2b --learners=8 --tpu_type=v5p-64 --override=data.path=gs://your-bucket/tokens --override=sync.period=24 --override=sync.num_fragments=24 --override=sync.quorum=1 --output=gemma-2b-decoupled-m8-k1-h24.yaml
kubectl apply -f gemma-2b-decoupled-m8-k1-h24.yaml

# gemma_2b decoupled M=8 K=8 H=24: 8 x v5p-64 + a CPU syncer
diloco jobset --name=dd-gemma-2b-decoupled-m8-k8-h24 --image=REGISTRY/diloco:latest --store=gs://your-bucket/sweep/gemma-2b-decoupled-m8-k8-h24 --config=configs/decoupled.py:gemma_2b --learners=8 --tpu_type=v5p-64 --override=data.path=gs://your-bucket/tokens --override=sync.period=24 --override=sync.num_fragments=24 --override=sync.quorum=0 --output=gemma-2b-decoupled-m8-k8-h24.yaml
kubectl apply -f gemma-2b-decoupled-m8-k8-h24.yaml

# gemma_5b dp: on every host of one v5p-128 slice
python -m diloco.main --config=configs/dp.py:gemma_5b --workdir=gs://your-bucket/sweep/gemma-5b-dp --jax_distributed --config.data.path=gs://your-bucket/tokens

# gemma_5b diloco M=8 K=8 H=24: 8 x v5p-128 + a CPU syncer
diloco jobset --name=dd-gemma-5b-diloco-m8-k8-h24 --image=REGISTRY/diloco:latest --store=gs://your-bucket/sweep/gemma-5b-diloco-m8-k8-h24 --config=configs/diloco.py:gemma_5b --learners=8 --tpu_type=v5p-128 --override=data.path=gs://your-bucket/tokens --override=sync.period=24 --override=sync.num_fragments=1 --output=gemma-5b-diloco-m8-k8-h24.yaml
kubectl apply -f gemma-5b-diloco-m8-k8-h24.yaml

# gemma_5b streaming M=8 K=8 H=24: 8 x v5p-128 + a CPU syncer
diloco jobset --name=dd-gemma-5b-streaming-m8-k8-h24 --image=REGISTRY/diloco:latest --store=gs://your-bucket/sweep/gemma-5b-streaming-m8-k8-h24 --config=configs/streaming.py:gemma_5b --learners=8 --tpu_type=v5p-128 --override=data.path=gs://your-bucket/tokens --override=sync.period=24 --override=sync.num_fragments=24 --output=gemma-5b-streaming-m8-k8-h24.yaml
kubectl apply -f gemma-5b-streaming-m8-k8-h24.yaml

# gemma_5b decoupled M=8 K=1 H=24: 8 x v5p-128 + a CPU syncer
diloco jobset --name=dd-gemma-5b-decoupled-m8-k1-h24 --image=REGISTRY/diloco:latest --store=gs://your-bucket/sweep/gemma-5b-decoupled-m8-k1-h24 --config=configs/decoupled.py:gemma_5b --learners=8 --tpu_type=v5p-128 --override=data.path=gs://your-bucket/tokens --override=sync.period=24 --override=sync.num_fragments=24 --override=sync.quorum=1 --output=gemma-5b-decoupled-m8-k1-h24.yaml
kubectl apply -f gemma-5b-decoupled-m8-k1-h24.yaml

# gemma_5b decoupled M=8 K=8 H=24: 8 x v5p-128 + a CPU syncer
diloco jobset --name=dd-gemma-5b-decoupled-m8-k8-h24 --image=REGISTRY/diloco:latest --store=gs://your-bucket/sweep/gemma-5b-decoupled-m8-k8-h24 --config=configs/decoupled.py:gemma_5b --learners=8 --tpu_type=v5p-128 --override=data.path=gs://your-bucket/tokens --override=sync.period=24 --override=sync.num_fragments=24 --override=sync.quorum=0 --output=gemma-5b-decoupled-m8-k8-h24.yaml
kubectl apply -f gemma-5b-decoupled-m8-k8-h24.yaml

# gemma_9b dp: on every host of one v5p-256 slice
python -m diloco.main --config=configs/dp.py:gemma_9b --workdir=gs://your-bucket/sweep/gemma-9b-dp --jax_distributed --config.data.path=gs://your-bucket/tokens

# gemma_9b diloco M=8 K=8 H=24: 8 x v5p-256 + a CPU syncer
diloco jobset --name=dd-gemma-9b-diloco-m8-k8-h24 --image=REGISTRY/diloco:latest --store=gs://your-bucket/sweep/gemma-9b-diloco-m8-k8-h24 --config=configs/diloco.py:gemma_9b --learners=8 --tpu_type=v5p-256 --override=data.path=gs://your-bucket/tokens --override=sync.period=24 --override=sync.num_fragments=1 --output=gemma-9b-diloco-m8-k8-h24.yaml
kubectl apply -f gemma-9b-diloco-m8-k8-h24.yaml

# gemma_9b streaming M=8 K=8 H=24: 8 x v5p-256 + a CPU syncer
diloco jobset --name=dd-gemma-9b-streaming-m8-k8-h24 --image=REGISTRY/diloco:latest --store=gs://your-bucket/sweep/gemma-9b-streaming-m8-k8-h24 --config=configs/streaming.py:gemma_9b --learners=8 --tpu_type=v5p-256 --override=data.path=gs://your-bucket/tokens --override=sync.period=24 --override=sync.num_fragments=24 --output=gemma-9b-streaming-m8-k8-h24.yaml
kubectl apply -f gemma-9b-streaming-m8-k8-h24.yaml

# gemma_9b decoupled M=8 K=1 H=24: 8 x v5p-256 + a CPU syncer
diloco jobset --name=dd-gemma-9b-decoupled-m8-k1-h24 --image=REGISTRY/diloco:latest --store=gs://your-bucket/sweep/gemma-9b-decoupled-m8-k1-h24 --config=configs/decoupled.py:gemma_9b --learners=8 --tpu_type=v5p-256 --override=data.path=gs://your-bucket/tokens --override=sync.period=24 --override=sync.num_fragments=24 --override=sync.quorum=1 --output=gemma-9b-decoupled-m8-k1-h24.yaml
kubectl apply -f gemma-9b-decoupled-m8-k1-h24.yaml

# gemma_9b decoupled M=8 K=8 H=24: 8 x v5p-256 + a CPU syncer
diloco jobset --name=dd-gemma-9b-decoupled-m8-k8-h24 --image=REGISTRY/diloco:latest --store=gs://your-bucket/sweep/gemma-9b-decoupled-m8-k8-h24 --config=configs/decoupled.py:gemma_9b --learners=8 --tpu_type=v5p-256 --override=data.path=gs://your-bucket/tokens --override=sync.period=24 --override=sync.num_fragments=24 --override=sync.quorum=0 --output=gemma-9b-decoupled-m8-k8-h24.yaml
kubectl apply -f gemma-9b-decoupled-m8-k8-h24.yaml

# moe_2_8b dp: on every host of one v5p-128 slice
python -m diloco.main --config=configs/dp.py:moe_2_8b --workdir=gs://your-bucket/sweep/moe-2-8b-dp --jax_distributed --config.data.path=gs://your-bucket/tokens

# moe_2_8b diloco M=8 K=8 H=24: 8 x v5p-128 + a CPU syncer
diloco jobset --name=dd-moe-2-8b-diloco-m8-k8-h24 --image=REGISTRY/diloco:latest --store=gs://your-bucket/sweep/moe-2-8b-diloco-m8-k8-h24 --config=configs/diloco.py:moe_2_8b --learners=8 --tpu_type=v5p-128 --override=data.path=gs://your-bucket/tokens --override=sync.period=24 --override=sync.num_fragments=1 --output=moe-2-8b-diloco-m8-k8-h24.yaml
kubectl apply -f moe-2-8b-diloco-m8-k8-h24.yaml

# moe_2_8b streaming M=8 K=8 H=24: 8 x v5p-128 + a CPU syncer
diloco jobset --name=dd-moe-2-8b-streaming-m8-k8-h24 --image=REGISTRY/diloco:latest --store=gs://your-bucket/sweep/moe-2-8b-streaming-m8-k8-h24 --config=configs/streaming.py:moe_2_8b --learners=8 --tpu_type=v5p-128 --override=data.path=gs://your-bucket/tokens --override=sync.period=24 --override=sync.num_fragments=24 --output=moe-2-8b-streaming-m8-k8-h24.yaml
kubectl apply -f moe-2-8b-streaming-m8-k8-h24.yaml

# moe_2_8b decoupled M=8 K=1 H=24: 8 x v5p-128 + a CPU syncer
diloco jobset --name=dd-moe-2-8b-decoupled-m8-k1-h24 --image=REGISTRY/diloco:latest --store=gs://your-bucket/sweep/moe-2-8b-decoupled-m8-k1-h24 --config=configs/decoupled.py:moe_2_8b --learners=8 --tpu_type=v5p-128 --override=data.path=gs://your-bucket/tokens --override=sync.period=24 --override=sync.num_fragments=24 --override=sync.quorum=1 --output=moe-2-8b-decoupled-m8-k1-h24.yaml
kubectl apply -f moe-2-8b-decoupled-m8-k1-h24.yaml

# moe_2_8b decoupled M=8 K=8 H=24: 8 x v5p-128 + a CPU syncer
diloco jobset --name=dd-moe-2-8b-decoupled-m8-k8-h24 --image=REGISTRY/diloco:latest --store=gs://your-bucket/sweep/moe-2-8b-decoupled-m8-k8-h24 --config=configs/decoupled.py:moe_2_8b --learners=8 --tpu_type=v5p-128 --override=data.path=gs://your-bucket/tokens --override=sync.period=24 --override=sync.num_fragments=24 --override=sync.quorum=0 --output=moe-2-8b-decoupled-m8-k8-h24.yaml
kubectl apply -f moe-2-8b-decoupled-m8-k8-h24.yaml

# moe_3_8b dp: on every host of one v5p-128 slice
python -m diloco.main --config=configs/dp.py:moe_3_8b --workdir=gs://your-bucket/sweep/moe-3-8b-dp --jax_distributed --config.data.path=gs://your-bucket/tokens

# moe_3_8b diloco M=8 K=8 H=24: 8 x v5p-128 + a CPU syncer
diloco jobset --name=dd-moe-3-8b-diloco-m8-k8-h24 --image=REGISTRY/diloco:latest --store=gs://your-bucket/sweep/moe-3-8b-diloco-m8-k8-h24 --config=configs/diloco.py:moe_3_8b --learners=8 --tpu_type=v5p-128 --override=data.path=gs://your-bucket/tokens --override=sync.period=24 --override=sync.num_fragments=1 --output=moe-3-8b-diloco-m8-k8-h24.yaml
kubectl apply -f moe-3-8b-diloco-m8-k8-h24.yaml

# moe_3_8b streaming M=8 K=8 H=24: 8 x v5p-128 + a CPU syncer
diloco jobset --name=dd-moe-3-8b-streaming-m8-k8-h24 --image=REGISTRY/diloco:latest --store=gs://your-bucket/sweep/moe-3-8b-streaming-m8-k8-h24 --config=configs/streaming.py:moe_3_8b --learners=8 --tpu_type=v5p-128 --override=data.path=gs://your-bucket/tokens --override=sync.period=24 --override=sync.num_fragments=24 --output=moe-3-8b-streaming-m8-k8-h24.yaml
kubectl apply -f moe-3-8b-streaming-m8-k8-h24.yaml

# moe_3_8b decoupled M=8 K=1 H=24: 8 x v5p-128 + a CPU syncer
diloco jobset --name=dd-moe-3-8b-decoupled-m8-k1-h24 --image=REGISTRY/diloco:latest --store=gs://your-bucket/sweep/moe-3-8b-decoupled-m8-k1-h24 --config=configs/decoupled.py:moe_3_8b --learners=8 --tpu_type=v5p-128 --override=data.path=gs://your-bucket/tokens --override=sync.period=24 --override=sync.num_fragments=24 --override=sync.quorum=1 --output=moe-3-8b-decoupled-m8-k1-h24.yaml
kubectl apply -f moe-3-8b-decoupled-m8-k1-h24.yaml

# moe_3_8b decoupled M=8 K=8 H=24: 8 x v5p-128 + a CPU syncer
diloco jobset --name=dd-moe-3-8b-decoupled-m8-k8-h24 --image=REGISTRY/diloco:latest --store=gs://your-bucket/sweep/moe-3-8b-decoupled-m8-k8-h24 --config=configs/decoupled.py:moe_3_8b --learners=8 --tpu_type=v5p-128 --override=data.path=gs://your-bucket/tokens --override=sync.period=24 --override=sync.num_fragments=24 --override=sync.quorum=0 --output=moe-3-8b-decoupled-m8-k8-h24.yaml
kubectl apply -f moe-3-8b-decoupled-m8-k8-h24.yaml
