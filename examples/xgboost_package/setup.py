"""An XGBoost trainer package laid out as Vertex AI's prebuilt XGBoost containers expect."""

from setuptools import find_packages, setup

setup(
    name="trainer",
    version="0.1",
    packages=find_packages(),
    install_requires=["xgboost", "scikit-learn"],
    description="Digits classifier with XGBoost; writes model.bst to AIP_MODEL_DIR",
)
