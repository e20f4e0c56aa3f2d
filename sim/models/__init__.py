"""Bus-functional models for cocotb benches."""
