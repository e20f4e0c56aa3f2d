"""cocotb test modules: one bench per design or system, run by pytest (and bench/) by
dotted name through :func:`fpgaccl.sim.runner.run`."""
