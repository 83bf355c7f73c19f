"""Start the DeltaS video memory node (a managed node) with config/deltas.yaml.

    ros2 launch deltas_ros deltas.launch.py model_path:=/models/qwen3.5-9b \
        image_topic:=/camera/color/image_raw
    ros2 launch deltas_ros deltas.launch.py     # the shipped scene model, /camera/image_raw
    ros2 launch deltas_ros deltas.launch.py autostart:=false   # for a lifecycle manager
"""

import os

from ament_index_python.packages import get_package_share_directory
from launch.actions import DeclareLaunchArgument, ExecuteProcess
from launch.conditions import IfCondition
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode
from launch_ros.parameter_descriptions import ParameterValue

from launch import LaunchDescription


def generate_launch_description() -> LaunchDescription:
    default_params = os.path.join(get_package_share_directory("deltas_ros"), "config",
                                  "deltas.yaml")
    arguments = [
        DeclareLaunchArgument("model_path", default_value="",
                              description="Local Qwen3.5 model directory (empty: the shipped "
                                          "scene model)"),
        DeclareLaunchArgument("image_topic", default_value="/camera/image_raw",
                              description="Camera topic (sensor_msgs/Image)"),
        DeclareLaunchArgument("params_file", default_value=default_params,
                              description="Parameters YAML for the node"),
        DeclareLaunchArgument("namespace", default_value="", description="Node namespace"),
        DeclareLaunchArgument("use_sim_time", default_value="false",
                              description="Follow /clock (bag replay)"),
        DeclareLaunchArgument("autostart", default_value="true",
                              description="Configure and activate by itself (false: wait for "
                                          "a lifecycle manager)"),
        DeclareLaunchArgument("dashboard", default_value="false",
                              description="Also serve the read-only browser dashboard on "
                                          "127.0.0.1:8080 (docs/dashboard.md)"),
    ]
    node = LifecycleNode(
        package="deltas_ros",
        executable="memory_node",
        name="deltas_memory",
        namespace=LaunchConfiguration("namespace"),
        output="screen",
        emulate_tty=True,
        parameters=[
            LaunchConfiguration("params_file"),
            {
                "model_path": LaunchConfiguration("model_path"),
                "image_topic": LaunchConfiguration("image_topic"),
                "use_sim_time": ParameterValue(LaunchConfiguration("use_sim_time"),
                                               value_type=bool),
                "autostart": ParameterValue(LaunchConfiguration("autostart"), value_type=bool),
            },
        ],
    )
    # A separate process: the memory node never imports the dashboard.
    dashboard = ExecuteProcess(
        cmd=["deltas-ros", "dashboard", "--node",
             [LaunchConfiguration("namespace"), "/deltas_memory"]],
        output="screen", condition=IfCondition(LaunchConfiguration("dashboard")))
    return LaunchDescription([*arguments, node, dashboard])
