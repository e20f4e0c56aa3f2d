"""Simulation-only hardware: memory, links and switch models that run inside Verilator
with the nodes, so multi-node simulations keep Python off the per-cycle path."""
