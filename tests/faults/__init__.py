"""Fault-injection suite: crashes, full disks and write ordering around checkpoints."""
