"""ds_chimera: pipeline schedules (Chimera, breadth-first, PipeOptim, zero-bubble...) for DeepSpeed."""
import glob
import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildPyWithKernelSources(build_py):
    """Ship csrc/ inside the package, so an installed copy can JIT-build the CPU kernels."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "ds_chimera", "csrc")
        os.makedirs(target, exist_ok=True)
        for source in glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "*.cpp")):
            shutil.copy(source, target)


setup(
    name="ds_chimera",
    version="0.1.0",
    description="Drop-in pipeline schedules for DeepSpeed, Megatron-Core and the HF Trainer",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["ds_chimera", "ds_chimera.*"]),
    install_requires=["numpy", "matplotlib"],
    extras_require={
        "torch": ["torch", "deepspeed"],
        "test": ["pytest", "torch", "deepspeed"],
        "hf": ["transformers", "accelerate", "deepspeed"],
        "megatron": ["megatron-core", "deepspeed"],
    },
    cmdclass={"build_py": BuildPyWithKernelSources},
    entry_points={
        "console_scripts": ["ds-chimera = ds_chimera.cli:main"],
        "ds_chimera.kernels": [
            "torch = ds_chimera.ops.backends:TorchBackend",
            "cpp = ds_chimera.ops.backends:CppBackend",
            "triton = ds_chimera.ops.backends:TritonBackend",
        ],
    },
)
