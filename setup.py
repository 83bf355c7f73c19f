"""pip install of the ROS-free core and the `deltas-ros` command, for a workstation without ROS.

On a robot the package is built by colcon from CMakeLists.txt (ament_cmake: it generates the
msg/srv interfaces and installs these same modules), which ignores this file. Here it serves the
offline path: `pip install .` into a plain venv gives the engine, `deltas-ros make-model`, `synth`
and `run` on bags and videos. The node, `replay` and `ask` need rclpy and a ROS build.
Do not pip-install into the ROS venv: it would replace the CMake-installed package.
"""

import re
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).parent
SUBPACKAGES = ("core", "runtime", "ros", "tools", "training")
VERSION = re.search(r"<version>([^<]+)</version>", (HERE / "package.xml").read_text()).group(1)

setup(
    name="deltas_ros",
    version=VERSION,
    description="Bounded long-horizon video memory (DeltaS on Qwen3.5): ROS-free core and CLI",
    license="Apache-2.0",
    packages=["deltas_ros", *(f"deltas_ros.{sub}" for sub in SUBPACKAGES)],
    # The shipped scene model (deltas_ros/models/scenes-tiny), the default model.
    package_data={"deltas_ros": ["models/*/*", "ros/dashboard.html", "ros/dashboard*.js"]},
    python_requires=">=3.10",
    install_requires=[
        "numpy",
        "torch",
        "torchvision",
        "transformers>=5.24,<5.25",  # backend.py uses private names; see test_backend
        "safetensors",
        "tokenizers",
        "opencv-python-headless",
        "simplejpeg",
        "rosbags",
        "matplotlib",
        "tqdm",
        "aiohttp",  # the dashboard's HTTP server
    ],
    # fla's Triton kernels for the Gated DeltaNet layers on CUDA (torch's are used without it).
    extras_require={"cuda": ["flash-linear-attention==0.6.0"]},
    entry_points={"console_scripts": ["deltas-ros = deltas_ros.tools.cli:main"]},
)
