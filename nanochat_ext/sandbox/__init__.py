"""Untrusted code run sealed: the code tasks' judge (its cgroup, seccomp filter, the wall and the code's process)."""
