"""The ROS 2 side: the lifecycle node and its executable, the camera and message adapters, the
services and the ask action, CDR decoding, bag replay and the ask client. It imports the
runtime and the core."""
