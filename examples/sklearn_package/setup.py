"""A scikit-learn trainer package laid out as Vertex AI's prebuilt scikit-learn containers expect."""

from setuptools import find_packages, setup

setup(
    name="trainer",
    version="0.1",
    packages=find_packages(),
    install_requires=["scikit-learn", "joblib"],
    description="Digits classifier with scikit-learn; writes model.joblib to AIP_MODEL_DIR",
)
