from setuptools import find_packages, setup

# Metadata lives in setup.cfg; the package list lives here, because one entry is no folder
# of mcsd/: the shipped models the default run reads (models/ beside the package in a
# checkout) go into the wheel as mcsd/models, where an installed copy finds them beside its
# code (mcsd.loading.cache.models_dir). The standalone draft (models/smollm2-135m-draft,
# --drafter model) stays in the checkout.
SHIPPED_MODELS = ["smollm2-135m-feature-head/*", "decision-models/*"]

setup(
    packages=find_packages(include=["mcsd", "mcsd.*"]) + ["mcsd.models"],
    package_dir={"mcsd.models": "models"},
    package_data={
        "mcsd.forward": ["q4_kernel.c"],    # the native q4 kernel's source, compiled on first use
        "mcsd.models": SHIPPED_MODELS,
    },
)
