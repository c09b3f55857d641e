"""Train a digits classifier with XGBoost: `python -m trainer.task [--max-depth 4] [--rounds 30]`.

A single-process XGBoost trainer as Vertex AI runs one: train with ``xgboost.train``, score
on held-out rows, report the score (cloudml-hypertune), and write ``model.bst`` to
AIP_MODEL_DIR (a local folder here), where the prebuilt XGBoost serving container looks for it.
"""

import argparse
import os

import hypertune
import numpy as np
import xgboost as xgb
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-depth", "--max_depth", dest="max_depth", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--job-dir", default=None, help="where outputs go when AIP_MODEL_DIR is not set")
    args = parser.parse_args()
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0)
    params = {"objective": "multi:softprob", "num_class": 10, "max_depth": args.max_depth, "eta": 0.3}
    booster = xgb.train(params, xgb.DMatrix(x_train, label=y_train), num_boost_round=args.rounds)
    accuracy = float(np.mean(booster.predict(xgb.DMatrix(x_test)).argmax(1) == y_test))
    print(f"test accuracy {accuracy:.4f}")
    hypertune.HyperTune().report_hyperparameter_tuning_metric(hyperparameter_metric_tag="accuracy",
                                                              metric_value=accuracy)
    folder = os.environ.get("AIP_MODEL_DIR") or os.path.join(args.job_dir or ".", "model")
    os.makedirs(folder, exist_ok=True)
    booster.save_model(os.path.join(folder, "model.bst"))
    print(f"model written to {os.path.join(folder, 'model.bst')}")


if __name__ == "__main__":
    main()
