"""Agent workloads: tasks with checkable answers and multi-turn episodes built from source material."""
