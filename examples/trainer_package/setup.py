"""A trainer package laid out as Vertex AI / AI Platform custom training expects it.

gcloud builds it with `python setup.py sdist`; the launcher ships the folder and
installs install_requires on every node.
"""

from setuptools import find_packages, setup

setup(
    name="trainer",
    version="0.1",
    packages=find_packages(),
    install_requires=["cloudml-hypertune"],
    description="Digits classifier, trained with torch DDP; resumes from AIP_CHECKPOINT_DIR",
)
