"""Chameleon: plans, schedules, simulation and recovery planning for fault-tolerant training."""
