"""Maps the repository's three parts onto one import package: k3compile, k3compile.model, k3compile.patterns."""
from setuptools import find_packages, setup

MAPPED = {"k3compile.model": "model", "k3compile.patterns": "patterns"}

packages = find_packages(include=["k3compile", "k3compile.*"])
package_dir = {"k3compile": "k3compile"}
for name, folder in MAPPED.items():
    package_dir[name] = folder
    packages += [name + sub[len(folder):] for sub in find_packages(include=[folder, folder + ".*"])]

setup(packages=packages, package_dir=package_dir)
