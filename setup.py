"""Packaging glue: ship the top-level `schemas/` folder inside the package as `flowrec/schemas`
(pyproject.toml holds everything else)."""
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["flowrec", "flowrec.*", "operators", "operators.*"]) + ["flowrec.schemas"],
    package_dir={"flowrec.schemas": "schemas"},
    package_data={"flowrec.schemas": ["*.json"]},
)
