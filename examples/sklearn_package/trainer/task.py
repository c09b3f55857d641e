"""Train a digits classifier with scikit-learn: `python -m trainer.task [--C 1.0] [--job-dir DIR]`.

What a Vertex AI scikit-learn trainer does, and nothing more: fit, score on held-out rows,
report the score to the tuning service (cloudml-hypertune), and write ``model.joblib`` to
AIP_MODEL_DIR (a local folder or gs://), where the prebuilt serving container looks for it.
"""

import argparse
import os
import tempfile

import hypertune
import joblib
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler


def save(model, folder: str) -> str:
    """model.joblib into ``folder``: a local path, or gs:// through google-cloud-storage."""
    if not folder.startswith("gs://"):
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "model.joblib")
        joblib.dump(model, path)
        return path
    from google.cloud import storage

    bucket, _, prefix = folder[len("gs://"):].partition("/")
    with tempfile.TemporaryDirectory() as d:
        local = os.path.join(d, "model.joblib")
        joblib.dump(model, local)
        name = prefix.rstrip("/") + "/model.joblib" if prefix else "model.joblib"
        storage.Client().bucket(bucket).blob(name).upload_from_filename(local)
    return f"gs://{bucket}/{name}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--C", type=float, default=1.0, help="inverse regularisation strength")
    parser.add_argument("--job-dir", default=None, help="where outputs go when AIP_MODEL_DIR is not set")
    args = parser.parse_args()
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0)
    model = make_pipeline(StandardScaler(), LogisticRegression(C=args.C, max_iter=2000))
    model.fit(x_train, y_train)
    accuracy = model.score(x_test, y_test)
    print(f"test accuracy {accuracy:.4f}")
    hypertune.HyperTune().report_hyperparameter_tuning_metric(hyperparameter_metric_tag="accuracy",
                                                              metric_value=accuracy)
    folder = os.environ.get("AIP_MODEL_DIR") or os.path.join(args.job_dir or ".", "model")
    print(f"model written to {save(model, folder)}")


if __name__ == "__main__":
    main()
