"""deltas_ros: a bounded long-horizon video memory for robots (DeltaS on Qwen3.5).

The core modules (frames, chunks, drift, policy, model, memory) import without rclpy; the node is a
thin ROS 2 adapter on top of them.
"""

# The generated msg/ and srv/ packages are installed into the build prefix. extend_path lets a
# source checkout on sys.path (pytest from the repository root) still find them there.
import warnings
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

# flash-linear-attention warns at import on machines without a GPU; model.py already picks the
# pure-torch gated-delta path there, so the warning only misleads.
warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
__version__ = "0.1.0"
