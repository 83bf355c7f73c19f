"""The package itself: manifest, CMake, setup.py and the generated interfaces agree and work."""

import json
import os
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import deltas_ros

REPO = Path(__file__).resolve().parents[1]
MANIFEST = ET.parse(REPO / "package.xml").getroot()


# setup.py's requirements by their rosdep keys, as rosdistro's rosdep/python.yaml names them
# (a `-pip` key where Debian/Ubuntu ship no package); None: no key exists, and package.xml says
# which package brings it (tokenizers and safetensors come with the transformers pip package).
ROSDEP = {"numpy": "python3-numpy", "opencv-python-headless": "python3-opencv",
          "torch": "python3-torch", "torchvision": "python3-torchvision",
          "transformers": "python3-transformers-pip", "safetensors": None, "tokenizers": None,
          "rosbags": "python3-rosbags-pip", "matplotlib": "python3-matplotlib",
          "tqdm": "python3-tqdm", "simplejpeg": None, "aiohttp": "python3-aiohttp"}


def manifest(tag: str) -> set[str]:
    return {e.text for e in MANIFEST.findall(tag)}


def test_manifest_is_format_3_interface_package():
    assert MANIFEST.get("format") == "3"
    assert manifest("member_of_group") == {"rosidl_interface_packages"}
    assert MANIFEST.find("export/build_type").text == "ament_cmake"


def test_cmake_setup_and_manifest_agree_on_name_version_and_dependencies():
    cmake = (REPO / "CMakeLists.txt").read_text()
    setup = (REPO / "setup.py").read_text()
    name, version = MANIFEST.find("name").text, MANIFEST.find("version").text
    assert re.search(r"project\((\w+)\)", cmake).group(1) == name
    assert f'name="{name}"' in setup and "package.xml" in setup  # version read from it
    found = set(re.findall(r"find_package\((\w+) REQUIRED", cmake)) - {"Python3"}
    declared = (manifest("buildtool_depend") | manifest("depend") | manifest("build_depend")
                | manifest("test_depend"))
    assert found <= declared, f"find_package without a manifest entry: {found - declared}"
    interface_deps = set(re.search(r"DEPENDENCIES ([\w ]+)", cmake).group(1).split())
    assert interface_deps <= manifest("depend")
    # Python dependencies of setup.py are exec dependencies of the ROS package too.
    requires = re.findall(r'"([a-z][\w-]+)(?:[<>=][^"]*)?",', setup.split("install_requires")[1]
                          .split("]")[0])
    missing = {ROSDEP[r] for r in requires if ROSDEP[r]} - manifest("exec_depend")
    assert not missing, f"setup.py requires what package.xml does not list: {missing}"
    assert deltas_ros.__version__ == version  # the one place Python code states it


def test_every_import_is_declared():
    """Third-party modules the package imports are in setup.py, the pins and, by rosdep key or
    by a comment saying why there is none, in package.xml. The pins a robot adds beside its own
    ROS 2 (requirements-core.txt) hold no ROS wheel and no build tool; the development venv's
    requirements.txt includes them."""
    setup, dev = (REPO / "setup.py").read_text(), (REPO / "requirements.txt").read_text()
    core = (REPO / "requirements-core.txt").read_text()
    pins = dev + core
    assert "\n-r requirements-core.txt\n" in dev
    core_pins = [line.split("==")[0] for line in core.splitlines() if "==" in line]
    assert not [p for p in core_pins if p.startswith("ros-") or p in ("cmake", "ninja")]
    for dist in ("torch", "transformers", "numpy", "rosbags", "tqdm", "aiohttp"):
        assert dist in core_pins and f'"{dist}' in setup, dist
    xml = (REPO / "package.xml").read_text()
    for dist in ("tokenizers", "safetensors"):
        assert f'"{dist}"' in setup and f"\n{dist}==" in pins, dist
        assert ROSDEP.get(dist) in manifest("exec_depend") or dist in xml, dist
    # fla (optional, CUDA only) is pinned in setup.py's cuda extra, which bench/gpu.sh installs;
    # the CPU venv goes without it (its kernels cannot run there, see backend.py).
    pin = '"flash-linear-attention==0.6.0"'
    assert f'"cuda": [{pin}]' in setup and "flash-linear-attention" in xml
    assert not any(line.startswith("flash-linear-attention") for line in pins.splitlines())
    assert "grep -o 'flash-linear-attention==" in (REPO / "bench" / "gpu.sh").read_text()
    ros = {"rclpy", "rcl_interfaces", "ament_index_python", "sensor_msgs", "nav_msgs",
           "geometry_msgs", "std_srvs", "std_msgs", "diagnostic_msgs", "lifecycle_msgs",
           "rosgraph_msgs", "builtin_interfaces", "action_msgs", "visualization_msgs", "launch",
           "launch_ros"}
    assert ros <= manifest("exec_depend") | manifest("depend")
    for name in ros - {"launch", "launch_ros", "ament_index_python", "rcl_interfaces", "rclpy"}:
        assert f"ros-{name.replace('_', '-')}==" in pins, name


def requirement_pins(name: str) -> dict[str, str]:
    """A requirements file's `name==version` lines (extras dropped) by name."""
    lines = (REPO / name).read_text().splitlines()
    return dict(re.sub(r"\[.*\]", "", line).split("==") for line in lines if "==" in line)


def test_jazzy_pins_are_kilteds_but_for_the_ros_wheels():
    """requirements-jazzy.txt is requirements.txt with Jazzy's ROS wheels in place of Kilted's
    (and colcon): the same tools and tests, requirements-core.txt included, every ROS package
    the node runs on pinned for both."""
    kilted = requirement_pins("requirements.txt")
    jazzy = requirement_pins("requirements-jazzy.txt")
    assert "\n-r requirements-core.txt\n" in (REPO / "requirements-jazzy.txt").read_text()
    assert ({k: v for k, v in kilted.items() if not k.startswith("ros-")}
            == {k: v for k, v in jazzy.items()
                if not k.startswith("ros-") and k != "colcon-common-extensions"})
    runtime = {k for k in kilted if k.startswith("ros-") and "cmake" not in k
               and "rosidl" not in k and k != "ros-ament-package"}
    assert runtime <= set(jazzy) and jazzy["ros-rclpy"].startswith("7.")


def test_every_interface_file_is_generated():
    cmake = (REPO / "CMakeLists.txt").read_text()
    for path in [*(REPO / "msg").glob("*.msg"), *(REPO / "srv").glob("*.srv"),
                 *(REPO / "action").glob("*.action")]:
        assert f'"{path.parent.name}/{path.name}"' in cmake


def test_interfaces_round_trip_through_rclpy_serialization():
    from builtin_interfaces.msg import Time
    from deltas_ros.msg import DriftScore
    from deltas_ros.srv import AskMemory
    from rclpy.serialization import deserialize_message, serialize_message

    drift = DriftScore(chunk_index=7, stream_time=3.5, drift=0.25, layer_drift=[0.5, 0.125],
                       chunk_tokens=116, kv_tokens=8192, evicted_tokens=116, forward_ms=107.0,
                       signal_ms=2.07, evict_ms=6.4)
    drift.header.stamp = Time(sec=1_700_000_000, nanosec=500_000_000)
    drift.header.frame_id = "camera"
    assert deserialize_message(serialize_message(drift), DriftScore) == drift

    request = AskMemory.Request(question="Where is the red cup?", max_new_tokens=32)
    assert deserialize_message(serialize_message(request), AskMemory.Request) == request
    response = AskMemory.Response(
        success=True, answer="on the table", evidence_times=[12.0, 40.5],
        evidence_stamps=[Time(sec=1, nanosec=2), Time(sec=3, nanosec=4)], memory_tokens=8192,
        memory_span_start=0.25, memory_span_end=3600.0, latency_ms=120.0)
    assert deserialize_message(serialize_message(response), AskMemory.Response) == response


def test_action_and_new_fields_round_trip():
    from builtin_interfaces.msg import Time
    from deltas_ros.action import AskMemory as Ask
    from deltas_ros.msg import DriftScore
    from deltas_ros.srv import AskMemory
    from geometry_msgs.msg import PoseStamped
    from rclpy.serialization import deserialize_message, serialize_message

    pose = PoseStamped()
    pose.header.frame_id, pose.header.stamp = "map", Time(sec=5)
    pose.pose.position.x, pose.pose.orientation.z, pose.pose.orientation.w = 1.5, 0.6, 0.8
    messages = [
        Ask.Goal(question="where?", max_new_tokens=4, since=10.0, until=20.5),
        Ask.Feedback(answer="on the", tokens=2),
        Ask.Result(success=True, message="", answer="on the table", evidence_times=[12.0],
                   evidence_stamps=[Time(sec=5)], evidence_poses=[pose], generated_tokens=3,
                   recalled_chunks=4, recalled_from_disk=1),
        AskMemory.Request(question="where?", since=1.0, until=2.0),
        AskMemory.Response(success=False, message="no", error="no", evidence_poses=[pose]),
        AskMemory.Response(success=True, answer="on the table", recalled_chunks=4,
                           recalled_from_disk=1),
        DriftScore(chunk_index=1, pose=pose),
    ]
    for message in messages:
        assert deserialize_message(serialize_message(message), type(message)) == message


def test_a_question_with_bytes_that_are_not_utf8_arrives_with_replacement_characters():
    """What a C++ client's broken string becomes in the node: the node refuses it for that."""
    from deltas_ros.srv import AskMemory
    from rclpy.serialization import deserialize_message, serialize_message

    from deltas_ros.core.memory import question_problem

    wire = serialize_message(AskMemory.Request(question="where is the cup?"))
    broken = wire.replace(b"cup", b"c\xffp")  # the same length, one invalid byte
    question = deserialize_message(broken, AskMemory.Request).question
    assert question == "where is the c\ufffdp?"
    assert "UTF-8" in question_problem(question, wire=True)


def test_generated_types_are_the_built_ones():
    from deltas_ros.msg import DriftScore
    from deltas_ros.srv import AskMemory

    assert DriftScore.__module__.startswith("deltas_ros.msg")
    assert AskMemory.Request.get_fields_and_field_types()["max_new_tokens"] == "uint32"
    assert AskMemory.Response.get_fields_and_field_types()["evidence_stamps"] == \
        "sequence<builtin_interfaces/Time>"


def test_executables_are_installed_where_ros2_run_looks():
    from ros_helpers import PREFIX as venv

    for exe in ("memory_node", "deltas-ros"):
        path = venv / "lib" / "deltas_ros" / exe
        assert path.exists() and path.stat().st_mode & 0o111, path
    assert (venv / "share" / "deltas_ros" / "launch" / "deltas.launch.py").exists()
    assert (venv / "share" / "deltas_ros" / "config" / "deltas.yaml").exists()


def test_ruff_is_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", str(REPO)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_setup_py_installs_the_ros_free_core_and_cli_into_a_plain_venv(tmp_path):
    """pip install . into a venv without ROS: the core imports without rclpy, the CLI runs.

    The new venv borrows torch & co. from the development venv through a .pth file (no
    multi-GB download in a test); rclpy is made unimportable in the checks.
    """
    source = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes((REPO / name).read_bytes())
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    (site / "site-packages" / "borrowed.pth").write_text(
        next(p for p in sys.path if p.endswith("site-packages")) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "--quiet", "--no-deps", "--no-build-isolation", str(source)],
                   check=True, cwd=tmp_path)
    check = ("import sys; sys.modules['rclpy'] = None\n"
             "import deltas_ros.core.memory, deltas_ros.core.frames, deltas_ros.core.policy\n"
             "import deltas_ros.tools.cli\n"
             "print(deltas_ros.core.memory.__file__)")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", check], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith(str(venv))  # the pip-installed copy, not the ROS build
    model = tmp_path / "model"
    result = subprocess.run([str(venv / "bin" / "deltas-ros"), "make-model", "--tiny",
                             str(model)], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert (model / "config.json").exists() and (model / "tokenizer.json").exists()


def setup_sh_configure_args(build: Path, venv: Path) -> list[str]:
    """scripts/setup.sh's CMake configure command (read from the script, so the two cannot
    drift apart), into `build`, with BUILD_TESTING switched on."""
    script = (REPO / "scripts" / "setup.sh").read_text().replace("\\\n", " ")
    line = next(line for line in script.splitlines()
                if '"$venv/bin/cmake" -S . -B "$build"' in line)
    command = line.split(">")[0].replace("$root", str(REPO)).replace("$venv", str(venv))
    args = shlex.split(command)[1:]  # without the cmake executable
    assert "-DBUILD_TESTING=OFF" in args and args[:4] == ["-S", ".", "-B", "$build"]
    return ["-S", str(REPO), "-B", str(build)] + [
        "-DBUILD_TESTING=ON" if arg == "-DBUILD_TESTING=OFF" else arg for arg in args[4:]]


def test_colcon_test_registers_the_pytest_suite(tmp_path):
    """`colcon test` runs ctest in the build folder: configured as scripts/setup.sh does but
    with BUILD_TESTING=ON, ctest knows the pytest suite, run on this package's test/ folder
    (listed, not run: the suite takes minutes)."""
    venv = Path(sys.prefix)  # .venv, or .venv-jazzy under scripts/test.sh --distro jazzy
    if not (venv / ".requirements.sha256").exists():
        pytest.skip("not a venv from scripts/setup.sh (colcon configures the package itself)")
    build = tmp_path / "build"
    cmake = [str(venv / "bin" / "cmake"), *setup_sh_configure_args(build, venv)]
    configure = subprocess.run(cmake, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]
    listed = subprocess.run([str(venv / "bin" / "ctest"), "--show-only=json-v1"], cwd=build,
                            capture_output=True, text=True, timeout=60, check=True)
    tests = {t["name"]: t for t in json.loads(listed.stdout)["tests"]}
    assert list(tests) == ["deltas_ros_pytest"]
    suite = tests["deltas_ros_pytest"]
    command = suite["command"]
    pytest_args = command[command.index("--command") + 1:]
    assert pytest_args[:4] == [str(venv / "bin" / "python"), "-u", "-m", "pytest"]
    assert Path(pytest_args[4]) == REPO / "test"
    assert "OMP_NUM_THREADS=1" in command[command.index("--env"):command.index("--command")]
    properties = {p["name"]: p["value"] for p in suite["properties"]}
    assert Path(properties["WORKING_DIRECTORY"]) == REPO


def test_colcon_builds_the_package_in_a_workspace_and_it_runs_from_the_install_space(tmp_path):
    """What a robot does: `colcon build` of this package in a workspace over the ROS prefix (here
    the wheels of the venv under test, Kilted's or Jazzy's, with setup.sh's wheel fix), then
    `source install/setup.bash`: the interfaces and the command come from the install space."""
    venv = Path(sys.prefix)
    if not (venv / "bin" / "colcon").exists():
        pytest.skip("colcon is not in this venv (requirements-jazzy.txt installs it)")
    package = tmp_path / "ws" / "src" / "deltas_ros"
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_bytes((REPO / name).read_bytes())
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
           "CMAKE_PREFIX_PATH": str(venv), "AMENT_PREFIX_PATH": str(venv)}
    build = subprocess.run(
        ["colcon", "build", "--packages-select", "deltas_ros", "--event-handlers",
         "console_cohesion-", "--cmake-args", "-G", "Ninja", "-DBUILD_TESTING=OFF",
         f"-DPython3_EXECUTABLE={venv / 'bin' / 'python'}",
         f"-DCMAKE_PROJECT_INCLUDE={REPO / 'cmake' / 'pypi_wheels_fix.cmake'}"],
        cwd=package.parents[1], env=env, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    install = package.parents[1] / "install"
    check = ("from deltas_ros.msg import DriftScore\n"
             "from rclpy.serialization import deserialize_message, serialize_message\n"
             "message = DriftScore(chunk_index=3, drift=0.5)\n"
             "assert deserialize_message(serialize_message(message), DriftScore) == message\n"
             "print(DriftScore.__module__, __import__('deltas_ros.msg').msg.__file__)")
    script = (f"source {shlex.quote(str(install / 'setup.bash'))}"
              f" && cd {shlex.quote(str(tmp_path))} && python -c {shlex.quote(check)}"
              " && command -v deltas-ros && deltas-ros --help")
    ran = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                         timeout=120)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    (module, path), command = ran.stdout.splitlines()[0].split(), ran.stdout.splitlines()[1]
    assert module.startswith("deltas_ros.msg") and path.startswith(str(install)), ran.stdout
    assert command.startswith(str(install)), ran.stdout
    assert "usage: deltas-ros" in ran.stdout


def test_kilted_and_jazzy_generate_the_same_type_hashes():
    """Kilted's and Jazzy's rosidl give the interfaces the same type hashes (RIHS01), so a
    planner on one talks to a node on the other, and bags recorded on either replay on both.
    Skipped until scripts/setup.sh built both venvs (CI's Jazzy run has both)."""
    venvs = [REPO / ".venv", REPO / ".venv-jazzy"]
    shares = [venv / "share" / "deltas_ros" for venv in venvs]
    if not all((share / "msg" / "DriftScore.json").exists() for share in shares):
        pytest.skip("needs both venvs: scripts/setup.sh and scripts/setup.sh --distro jazzy")
    names = sorted(str(p.relative_to(shares[0])) for p in shares[0].glob("*/*.json"))
    assert len(names) == 5, names  # 2 messages, 2 services, 1 action
    for name in names:
        kilted, jazzy = (json.loads((share / name).read_text())["type_hashes"]
                         for share in shares)
        assert kilted == jazzy, name


SERVER = """
import time
import rclpy
from deltas_ros.srv import AskMemory
rclpy.init()
node, asked = rclpy.create_node("server"), []
def answer(request, response):
    response.success, response.answer = True, "heard " + request.question
    asked.append(request)
    return response
node.create_service(AskMemory, "ask_memory", answer)
deadline = time.monotonic() + 60
while time.monotonic() < deadline and not asked:
    rclpy.spin_once(node, timeout_sec=0.1)
end = time.monotonic() + 1.0  # the reply is acknowledged before the server leaves
while time.monotonic() < end:
    rclpy.spin_once(node, timeout_sec=0.1)
"""
CLIENT = """
import rclpy
from deltas_ros.srv import AskMemory
rclpy.init()
node = rclpy.create_node("client")
client = node.create_client(AskMemory, "ask_memory")
assert client.wait_for_service(timeout_sec=30), "no service"
future = client.call_async(AskMemory.Request(question="the red cup?", since=1.5))
rclpy.spin_until_future_complete(node, future, timeout_sec=30)
print(future.result().answer)
"""


@pytest.mark.parametrize("server, client", [("jazzy", "kilted"), ("kilted", "jazzy")])
def test_a_service_of_one_distribution_answers_a_client_of_the_other(server, client, ros_env):
    """The interfaces built by Kilted and by Jazzy talk over DDS: a planner on one distribution
    asks a node on the other. Skipped until scripts/setup.sh built both venvs."""
    python = {"kilted": REPO / ".venv" / "bin" / "python",
              "jazzy": REPO / ".venv-jazzy" / "bin" / "python"}
    if not all((p.parents[1] / "share" / "deltas_ros").exists() for p in python.values()):
        pytest.skip("needs both venvs: scripts/setup.sh and scripts/setup.sh --distro jazzy")
    # Each venv's Python sets its own library path at start-up (ros_wheels_bootstrapper), unless
    # it finds this process's: that would load the other distribution's libraries.
    env = {k: v for k, v in ros_env.items()
           if k not in ("LD_LIBRARY_PATH", "_ROS_WHEELS_BOOTSTRAP_COMPLETE")}
    serving = subprocess.Popen([str(python[server]), "-c", SERVER], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        asked = subprocess.run([str(python[client]), "-c", CLIENT], env=env,
                               capture_output=True, text=True, timeout=90)
    finally:
        _, err = serving.communicate(timeout=90)
    assert asked.returncode == 0 and asked.stdout.strip() == "heard the red cup?", \
        asked.stderr[-3000:] + err[-3000:]
    assert serving.returncode == 0, err[-3000:]
