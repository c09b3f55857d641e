"""A Horovod TensorFlow 2 script in the shape of Horovod's own synthetic benchmark.

Keras' ResNet50 (no pretrained weights) trained on random images with
``hvd.DistributedGradientTape``; rank 0 prints images per second per worker and in total.
It is an ordinary ``horovodrun`` script and runs unmodified under
``launcher run --script benchmarks/hvd_tf_synthetic.py --backend horovod --framework tensorflow``,
which is what ``benchmarks/hvd_tf_ratio.py`` compares, alternating the two launchers.

    TF_USE_LEGACY_KERAS=1 horovodrun -np 2 -H localhost:2 python benchmarks/hvd_tf_synthetic.py
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # Horovod's tape needs the legacy tf.keras
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=4, help="images per worker per step")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--warmup-batches", type=int, default=5)
    parser.add_argument("--batches-per-iter", type=int, default=5)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--json", default=None, help="rank 0 writes its figures here")
    args = parser.parse_args()

    hvd.init()
    model = tf.keras.applications.ResNet50(weights=None)
    optimizer = tf.keras.optimizers.SGD(0.01)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy()
    images = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
    labels = tf.random.uniform([args.batch_size], minval=0, maxval=999, dtype=tf.int64)

    @tf.function
    def step(first: bool):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if first:  # after the first step, when the optimizer's variables exist
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables, root_rank=0)

    step(True)
    for _ in range(args.warmup_batches - 1):
        step(False)
    rates = []
    for _ in range(args.iters):
        started = time.perf_counter()
        for _ in range(args.batches_per_iter):
            step(False)
        rates.append(args.batch_size * args.batches_per_iter / (time.perf_counter() - started))
    if hvd.rank() == 0:
        mean, spread = float(np.mean(rates)), float(1.96 * np.std(rates))
        print(f"Img/sec per worker: {mean:.2f} +-{spread:.2f}", flush=True)
        print(f"Total img/sec on {hvd.size()} worker(s): {hvd.size() * mean:.2f} +-{hvd.size() * spread:.2f}",
              flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"per_worker": mean, "total": hvd.size() * mean, "rates": rates,
                           "threads": {"intra": tf.config.threading.get_intra_op_parallelism_threads(),
                                       "inter": tf.config.threading.get_inter_op_parallelism_threads(),
                                       "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}}, f)


if __name__ == "__main__":
    main()
